"""The ``liger-models`` command line: ``demo``, ``train`` (causal-LM fine-tuning), ``train-medusa``, ``generate``
(plain or Medusa decoding of prompts, timed), ``chat`` (the same, interactively), ``calibrate-tree`` (a Medusa tree
fitted to trained heads), ``init-model`` and ``convert-native`` (Meta / Mistral native checkpoints → HF format).

Several GPUs: launch the same command with ``torchrun --nproc-per-node N -m liger_models.cli ...`` (FSDP2).

A recipe's flags are the fields of its config (liger_models/recipes/configs.py: ``--eval-data`` is ``eval_data``,
with the same default); this module parses them into it, calls the recipe, and reports a user's error in one line.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from liger_models.convert.native import native_to_hf
from liger_models.medusa.config import check_scheduler
from liger_models.train.bnb_optim import OPTIMIZERS
from liger_models.train.disk_space import DiskFull
from liger_models.train.init_model import init_model_dir


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {n}")
    return n


def _open_unit(value: str) -> float:
    x = float(value)
    if not 0 < x < 1:  # also NaN
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return x


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {n}")
    return n


def _seq_len(value: str) -> int:
    n = int(value)
    if n < 2:  # a 1-token window has nothing to predict: its only token starts it
        raise argparse.ArgumentTypeError(f"must be ≥ 2, got {n}")
    return n


# argparse names the type in its "invalid <name> value: 'abc'" message: "int", not the function's name.
_positive.__name__ = _non_negative.__name__ = _seq_len.__name__ = "int"


def _float_where(rule: str, holds):
    """An argparse type: a float for which ``holds`` is true, else the error "must be <rule>". NaN fails every
    comparison, so it is refused too."""

    def parse(value: str) -> float:
        x = float(value)
        if not holds(x):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return x

    parse.__name__ = "float"  # argparse names the type in its "invalid float value" message
    return parse


# Refused by the parser, before a model is loaded: a negative final LR ratio would end the cosine in gradient ascent,
# the others torch refuses only once the model and data are loaded, or takes silently.
_positive_float = _float_where("> 0", lambda x: x > 0)
_non_negative_float = _float_where("≥ 0", lambda x: x >= 0)
_ratio = _float_where("in [0, 1]", lambda x: 0 <= x <= 1)
_beta = _float_where("in [0, 1)", lambda x: 0 <= x < 1)


def _schedule(value: str) -> str:
    try:
        check_scheduler(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _add_common(p: argparse.ArgumentParser, *, lr_default: float | None, lr_help: str, out_default: str) -> None:
    p.add_argument("--model", required=True, help="model directory (HF format with tokenizer.json) or Hub repo id")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE",
                   help='.txt (one document per file) or .jsonl ({"text": ...} or {"messages": [...]} per line)')
    p.add_argument("--eval-data", nargs="+", metavar="FILE", default=None,
                   help="held-out .txt/.jsonl files: loss (and head accuracy) on them in eval.jsonl, every "
                        "--eval-every steps and at the end")
    p.add_argument("--eval-every", type=_non_negative, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=_positive, default=None,  # None: TrainConfig.eval_batches
                   help="eval micro-batches per process and evaluation, the same ones each time (default 20)")
    p.add_argument("--chat-template", default="auto", choices=("auto", "model", "simple"),
                   help="chat JSONL rendering: the model's jinja template, or the documented role-tagged one "
                        "(auto: the model's when it has one); loss on assistant turns only")
    p.add_argument("--data-cache", default=None, metavar="DIR",
                   help="keep the tokenized, packed data here and reuse it when data, tokenizer, chat template and "
                        "--seq-len are unchanged (default OUTPUT_DIR/.data_cache; one file per such setting, never "
                        "deleted automatically: remove the directory to reclaim space)")
    p.add_argument("--no-data-cache", action="store_true",
                   help="tokenize the data every run and write no cache (under torchrun every rank tokenizes)")
    p.add_argument("--seq-len", type=_seq_len, default=1024, help="tokens per packed sequence (default 1024)")
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences per micro-batch per GPU (default 8)")
    p.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--max-steps", type=_positive, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--lr", type=_positive_float, default=lr_default, help=lr_help)
    p.add_argument("--warmup-steps", type=_non_negative, default=None,
                   help="linear warmup steps, then cosine decay (default 5%% of --max-steps)")
    p.add_argument("--min-lr-ratio", type=_ratio, default=0.1, help="final LR / peak LR of the cosine (default 0.1)")
    p.add_argument("--weight-decay", type=_non_negative_float, default=0.0,
                   help="AdamW weight decay on matrices (default 0)")
    p.add_argument("--beta1", type=_beta, default=0.9)
    p.add_argument("--beta2", type=_beta, default=0.95)
    p.add_argument("--adam-eps", type=_positive_float, default=1e-8,
                   help="AdamW's ε, added to √v (default 1e-8; HF Trainer's adam_epsilon)")
    p.add_argument("--max-grad-norm", type=_non_negative_float, default=1.0,
                   help="gradient clipping; 0 disables (default 1.0)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="update each parameter inside backward and free its gradient at once (less memory, same "
                        "weights; needs --max-grad-norm 0, --grad-accum 1, one process)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="after 3 eager steps, replay each whole step (forward, backward, AdamW) from one CUDA graph: "
                        "no host overhead; fixed shapes, one GPU, no activation checkpointing, not with "
                        "--optimizer-in-backward")
    p.add_argument("--adamw", default="liger", choices=("liger", "torch"),
                   help="AdamW's step on CUDA: this project's one-pass Triton kernel (FusedAdamW, default) or torch's "
                        "fused AdamW; same math, state and checkpoints")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="adamw (default: moments in the parameters' dtype); or bitsandbytes' (HF Trainer's names; "
                        "pip install 'liger-models[bnb]'): adamw_8bit keeps the moments in 8 bits (2 bytes per "
                        "trained parameter instead of 4 in bf16 or 8 in fp32), paged_adamw_32bit keeps fp32 moments "
                        "in CUDA unified memory that pages out to host memory when the GPU runs short, "
                        "paged_adamw_8bit both. One process (not under torchrun), not with --cuda-graph")
    p.add_argument("--loss-scratch-mib", type=_positive, default=None, metavar="MIB",
                   help="cap the fused linear-CE's logits scratch at MIB MiB: the fp32 dW accumulator then becomes "
                        "the gradient in place (peak 4·V·H bytes + MIB instead of 6·V·H for an untied or tied "
                        "lm_head; more, smaller chunks, a little slower)")
    p.add_argument("--loss-grad-filter-eps", type=_open_unit, default=None, metavar="EPS",
                   help="approximate lm_head gradients: in each token chunk, skip the vocabulary columns where every "
                        "token's loss gradient is below EPS (2^-12 = 0.000244 is cut-cross-entropy's default). Pays "
                        "on peaked distributions (2x faster loss on the H200 benchmark's); rare tokens' lm_head rows "
                        "then get no gradient from such a chunk. Default: exact")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="parameter dtype; bf16 is pure bf16 (weights, grads, AdamW moments); auto = bf16 on CUDA, "
                        "fp32 on CPU")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: CUDA when available")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward (less memory, ~30%% more compute)")
    p.add_argument("--mlp-chunk-tokens", type=_positive, default=None, metavar="N",
                   help="run each decoder layer's MLP over checkpointed chunks of N rows: a layer holds the MLP's "
                        "intermediates for one chunk at a time (long sequences; one more MLP forward a step; not "
                        "for mixture-of-experts models)")
    p.add_argument("--output-dir", default=out_default, help=f"metrics.jsonl and checkpoints/ (default {out_default})")
    p.add_argument("--save-every", type=_non_negative, default=500,
                   help="checkpoint every N steps (always at the end; 0: only at the end)")
    p.add_argument("--keep-last", type=_positive, default=2, help="checkpoints to keep (default 2)")
    p.add_argument("--resume", default=None, metavar="auto|DIR",
                   help="continue from a checkpoint directory (or the newest checkpoint of an earlier run's "
                        "output directory), or 'auto' = the newest one in --output-dir if any; a damaged "
                        "checkpoint (its files not those its manifest lists) is passed over for the one before it")
    p.add_argument("--allow-changed-settings", default=None, metavar="NAME,...",
                   help="with --resume: go on although these settings differ from the checkpoint's (names as the "
                        "refusal lists them, e.g. lr,batch-size,model-weights; or all); the change is logged. "
                        "Without it a resume with other data, model weights, tokenizer or math options is refused")
    p.add_argument("--log-every", type=_positive, default=10, help="progress line every N steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (metrics.jsonl is still written)")


def _add_lora(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-r", type=_positive, default=None, metavar="R",
                   help="train LoRA adapters of rank R instead of the whole model (checkpoints hold the adapters)")
    p.add_argument("--lora-alpha", type=_positive_float, default=None, help="LoRA alpha (default 2 × r)")
    p.add_argument("--lora-targets", default="all-linear", metavar="NAMES",
                   help="all-linear, or comma-separated HF names (q_proj,v_proj,...; Phi3: qkv_proj,...; lm_head, "
                        "embed_tokens)")
    p.add_argument("--lora-dropout", type=_beta, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument("--lora-rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    p.add_argument("--lora-dora", action="store_true",
                   help="DoRA: also train a magnitude per output row of each adapted linear (PEFT's use_dora)")
    p.add_argument("--lora-modules-to-save", default=None, metavar="NAMES",
                   help="embed_tokens and/or lm_head (comma-separated): trained whole beside the adapters and saved "
                        "in the adapter, as PEFT's modules_to_save (untied embeddings only)")
    p.add_argument("--lora-layers", default=None, metavar="LAYERS",
                   help="adapters only in these decoder layers: indices and ranges, such as 0-7,12 (PEFT's "
                        "layers_to_transform; default every layer)")
    p.add_argument("--lora-token-rows", default=None, metavar="IDS",
                   help="token ids (and ranges, such as 32000-32007) whose embedding rows train beside the adapters: "
                        "added or untrained special tokens (PEFT's trainable_token_indices; a tied lm_head shares "
                        "the rows)")
    p.add_argument("--qlora", action="store_true", help="with --lora-r: NF4 (4-bit) base weights, quantised on load")


def build_parser() -> argparse.ArgumentParser:
    """The ``liger-models`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="liger-models",
        description="Natively fused Llama-family models: training, Medusa heads and a demo. "
                    "Multi-GPU: torchrun --nproc-per-node N -m liger_models.cli <command> ... (FSDP2).",
    )
    commands = "demo,train,train-medusa,merge-lora,generate,chat,calibrate-tree,init-model,convert-native"
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + commands + "}")

    demo = sub.add_parser("demo", help="train a small Llama + Medusa heads on the bundled Shakespeare text",
                          description="With no --model: train a byte-level BPE tokenizer (2K vocab) on the bundled "
                                      "tiny-Shakespeare text, pre-train a small Llama-architecture model on it, then "
                                      "train Medusa heads (stage 1) and print their accuracies, a sample and where the "
                                      "checkpoints are. About a minute on 2 CPU cores, less on a GPU.")
    demo.add_argument("--output-dir", default="runs/demo", help="where everything is written (default runs/demo)")
    demo.add_argument("--model", default=None, help="skip pre-training: train heads on this model directory")
    demo.add_argument("--quick", action="store_true", help="a tiny model and a few steps (seconds; for tests)")
    demo.add_argument("--pretrain-steps", type=_non_negative, default=None, help="override the pre-training steps")
    demo.add_argument("--medusa-steps", type=_positive, default=None, help="override the Medusa training steps")
    demo.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: CUDA when available")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_run_demo)

    init = sub.add_parser("init-model", help="write a randomly initialised model + BPE tokenizer (no download)",
                          description="A random-init Llama of a preset shape with a byte-level BPE tokenizer trained "
                                      "on the bundled text, e.g. to try multi-GPU training offline.")
    init.add_argument("--preset", default="demo", help="demo | llama-3.2-1b (default demo)")
    init.add_argument("--output-dir", required=True)
    init.add_argument("--tokenizer-vocab", type=_positive, default=2048, help="BPE vocabulary (default 2048)")
    init.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    init.add_argument("--device", default=None, choices=("cuda", "cpu"), help="where to initialise (default CPU)")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=_run_init)

    train = sub.add_parser("train", help="causal-LM fine-tuning (fused linear-cross-entropy loss)",
                           description="Fine-tune a model on text or chat data with packed sequences.")
    _add_common(train, lr_default=None, out_default="runs/train",
                lr_help="peak learning rate (default 2e-5; with --lora-r 2e-4, the adapters' usual rate)")
    _add_lora(train)
    train.set_defaults(func=_run_train)

    merge = sub.add_parser("merge-lora", help="merge a LoRA adapter into its base: a plain HF checkpoint",
                           description="W + s·B·A for every adapted linear (fp32, rounded once), written with the "
                                       "base's config and tokenizer files; transformers loads the result.")
    merge.add_argument("--adapter", required=True, metavar="DIR", help="adapter_config.json + adapter_model.safetensors")
    merge.add_argument("--out", required=True, metavar="DIR", help="HF checkpoint directory to write")
    merge.add_argument("--model", default=None, metavar="DIR",
                       help="the base (default: the adapter's base_model_name_or_path)")
    merge.add_argument("--qlora-base", action="store_true",
                       help="merge onto dequant(NF4(base)), the base a --qlora adapter trained against")
    merge.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="default: the base's")
    merge.set_defaults(func=_run_merge_lora)

    medusa = sub.add_parser("train-medusa", help="train Medusa heads (stage 1) or heads + base (stage 2)",
                            description="Medusa-1 (stage 1: frozen base, heads only) or Medusa-2 (stage 2: joint, "
                                        "base loss on, heads at --head-lr-multiplier × LR). Head k (1..K) predicts "
                                        "the token k+1 ahead with loss weight lambda0·decay^k·schedule(step).")
    _add_common(medusa, lr_default=None, out_default="runs/medusa",
                lr_help="base learning rate; heads train at lr × --head-lr-multiplier (default: 2.5e-4 in stage 1, "
                        "i.e. heads at 1e-3; 2e-5 in stage 2, 2e-4 with --lora-r)")
    medusa.add_argument("--stage", type=int, choices=(1, 2), default=1, help="1: heads only; 2: joint (default 1)")
    # None when not given: heads loaded by --init-heads or --resume must then match only the options given.
    medusa.add_argument("--num-heads", type=_positive, default=None, help="Medusa heads (default 5)")
    medusa.add_argument("--num-layers", type=_non_negative, default=None, help="ResBlocks per head (default 1)")
    medusa.add_argument("--share-lm-head", action="store_true", default=None,
                        help="project with the frozen base lm_head (Medusa 'version 2') instead of per-head copies")
    medusa.add_argument("--init-heads", default=None, metavar="DIR",
                        help="start from trained heads (e.g. stage 2 from a stage-1 checkpoint)")
    medusa.add_argument("--head-lr-multiplier", type=_positive_float, default=4.0,
                        help="heads' LR multiplier (default 4)")
    medusa.add_argument("--schedule", type=_schedule, default="constant",
                        help="heads' loss-weight warmup: constant | linear | sine | sine_<r> (default constant)")
    medusa.add_argument("--lambda0", type=_non_negative_float, default=0.2,
                        help="heads' loss coefficient (default 0.2)")
    medusa.add_argument("--decay", type=_non_negative_float, default=0.8, help="per-head weight decay^k (default 0.8)")
    medusa.add_argument("--base-loss-weight", type=_non_negative_float, default=None,
                        help="stage-2 weight of the base CE (default 1; stage 1 has none)")
    _add_lora(medusa)
    medusa.set_defaults(func=_run_medusa)

    _add_generate(sub)

    native = sub.add_parser("convert-native", help="convert a Meta Llama / Mistral native checkpoint to HF format",
                            description="Read params.json + consolidated.NN.pth (Meta, model-parallel ranks merged) "
                                        "or consolidated.safetensors (mistral-inference), permute q/k rows to HF's "
                                        "rotate-half RoPE layout and write config.json + safetensors into OUT "
                                        "(which must not exist or be empty). A Llama 3 tokenizer.model in tiktoken "
                                        "format or a SentencePiece BPE tokenizer.model[.vN] (Llama 1/2, Mistral) "
                                        "becomes tokenizer.json + tokenizer_config.json (the file is kept under "
                                        "original/); other tokenizer files (tekken.json) are copied as they are.")
    native.add_argument("src", metavar="SRC", help="native checkpoint directory (params.json + consolidated.*)")
    native.add_argument("out", metavar="OUT", help="HF checkpoint directory to create")
    native.add_argument("--family", default=None, choices=("llama", "mistral"),
                        help="default: from params.json's keys")
    native.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                        help="default: the checkpoint's dtype")
    native.add_argument("--rope-factor", type=_positive_float, default=None, metavar="FACTOR",
                        help="llama3 rope factor for use_scaled_rope checkpoints whose params.json does not name it "
                             "(default 8 as Llama 3.1; Llama 3.2 1B/3B need 32)")
    native.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    native.add_argument("--llama3-specials", default=None, choices=("3", "3.1"),
                        help="Meta's special-token list for a tiktoken tokenizer.model (default: 3.1 if params.json "
                             "names use_scaled_rope, else 3)")
    native.set_defaults(func=_run_convert_native)
    return parser


def _add_decoding(p: argparse.ArgumentParser, chat_only: bool) -> None:
    """The options generate and chat share: what to load, the chat rendering, the sampling, the tree."""
    p.add_argument("--model", default=None, help="model directory or Hub repo id (default: the base that "
                                                 "--medusa's config names, or the stage-2 directory itself)")
    p.add_argument("--medusa", default=None, metavar="DIR",
                   help="Medusa heads (a train-medusa checkpoint, Medusa/TGI or vLLM format) or a stage-2 dir")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter (a `train --lora-r` checkpoint) on the base: --model, else the one "
                        "its adapter_config.json names (--model DIR of an adapter alone does the same)")
    p.add_argument("--qlora-base", action="store_true",
                   help="quantise the base to NF4 as it loads (double quantisation, as `train --qlora` does): a "
                        "--qlora adapter decodes on the base it trained against, in about a quarter of the base's "
                        "memory")
    when = "" if chat_only else "--chat: "
    p.add_argument("--system", default=None, help=f"{when}a system turn opening the conversation")
    p.add_argument("--chat-template", default=None if not chat_only else "auto", choices=("auto", "model", "simple"),
                   help=f"{when}the model's jinja template or the simple one (default auto, as training)")
    p.add_argument("--max-new-tokens", type=_positive, default=None,
                   help="default: generation_config.json's budget, else 32")
    p.add_argument("--greedy", action="store_true", help="argmax decoding whatever generation_config.json says")
    p.add_argument("--temperature", type=_positive_float, default=None,
                   help="sample at this temperature (with --medusa: typical acceptance)")
    p.add_argument("--top-k", type=_non_negative, default=None,
                   help="plain decoding: sample from the top k (0: no cut)")
    p.add_argument("--top-p", type=_float_where("in (0, 1]", lambda x: 0 < x <= 1), default=None,
                   help="plain decoding: sample from the nucleus")
    p.add_argument("--repetition-penalty", type=_positive_float, default=None,
                   help="plain decoding: HF's repetition penalty (1: none; default generation_config.json's)")
    p.add_argument("--no-repeat-ngram-size", type=_non_negative, default=None,
                   help="plain decoding: never repeat an n-gram this long (0: off)")
    p.add_argument("--min-new-tokens", type=_non_negative, default=None,
                   help="plain decoding: no end-of-sequence before this many new tokens")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="plain decoding: end the text at this string (repeat for several)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    p.add_argument("--default-tree", action="store_true",
                   help="with --medusa: verify the default tree even where calibrate-tree saved one")
    _add_loading(p)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="decode prompts with a model, plain or with Medusa heads, timed",
                         description="Print each prompt's continuation (stdout) and its tokens/s (stderr). With "
                                     "--medusa: Medusa tree decoding (greedy, the output of plain greedy decoding "
                                     "up to bf16's near-tied argmaxes, which --compare checks; --temperature > 0: "
                                     "typical acceptance) and its tokens per base-model forward. On CUDA each step "
                                     "is one CUDA-graph replay.")
    gen.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for several)")
    gen.add_argument("--prompt-file", action="append", default=None, metavar="FILE",
                     help="a UTF-8 file whose whole text is one prompt (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="each prompt is a user turn, rendered with the chat template")
    gen.add_argument("--compare", action="store_true",
                     help="with --medusa: also time plain decoding of each prompt (and check greedy tokens match)")
    gen.add_argument("--batch-size", type=_positive, default=1,
                     help="decode this many prompts per call, left-padded (default 1: each on its own)")
    gen.add_argument("--tree-tokens", type=_non_negative, default=None,
                     help="with --medusa: cut the tree so that a batch's rows × its nodes stay within this many "
                          "tokens per verification call, keeping its most promising choices (default 96, measured "
                          "on an H200; 0: verify the whole tree at any batch size)")
    _add_decoding(gen, chat_only=False)
    gen.set_defaults(func=_run_generate)

    chat = sub.add_parser("chat", help="a conversation in the terminal, plain or with Medusa heads",
                          description="Read user turns line by line (stdin), answer each with the whole conversation "
                                      "so far rendered by the chat template, and print each reply's tokens/s (and "
                                      "Medusa's tokens per base-model forward) on stderr. /reset starts over; /exit "
                                      "or Ctrl-D ends.")
    _add_decoding(chat, chat_only=True)
    chat.set_defaults(func=_run_chat)

    fit = sub.add_parser("calibrate-tree", help="fit a Medusa tree to trained heads (saved next to them)",
                         description="Greedy-decode prompts from the data, measure where each head's top-10 holds the "
                                     "base model's tokens, and keep the --size choices that would have been accepted "
                                     "most often. Writes medusa_choices.json into --medusa, which generate and "
                                     "MedusaModel.generate then use.")
    fit.add_argument("--medusa", required=True, metavar="DIR", help="the heads directory (written into)")
    fit.add_argument("--model", default=None, help="the base (default: the one the heads' config names)")
    fit.add_argument("--data", required=True, nargs="+", metavar="FILE",
                     help="held-out .txt/.jsonl files like the text the heads will decode")
    fit.add_argument("--prompts", type=_positive, default=32, help="prompts to decode (default 32)")
    fit.add_argument("--prompt-tokens", type=_positive, default=64, help="plain-text prompt length (default 64)")
    fit.add_argument("--new-tokens", type=_positive, default=128, help="greedy tokens per prompt (default 128)")
    fit.add_argument("--size", type=_positive, default=63,
                     help="the tree's choices, root excluded (default 63, as Medusa's shipped trees)")
    fit.add_argument("--chat-template", default="auto", choices=("auto", "model", "simple"),
                     help="for chat .jsonl, as in training (default auto)")
    _add_loading(fit)
    fit.set_defaults(func=_run_calibrate)


def _add_loading(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="default: the checkpoint's dtype")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: CUDA when available")
    p.add_argument("--no-cuda-graph", action="store_true", help="on CUDA, decode every step eagerly")


def _recipes():
    """liger_models.recipes, imported when a command runs rather than for ``--help`` or a parse error: the training
    machinery it loads (torch.distributed's checkpoint modules) would double the time ``--help`` takes."""
    from liger_models import recipes

    return recipes


def _run_train(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.train_causal_lm(recipes.FinetuneConfig.from_args(args))


def _run_merge_lora(args: argparse.Namespace) -> None:
    from liger_models.recipes.lora import merge_lora_command

    out = merge_lora_command(args)
    print(f"wrote {out}")


def _run_medusa(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.train_medusa(recipes.MedusaTrainingConfig.from_args(args))


def _run_init(args: argparse.Namespace) -> None:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = init_model_dir(args.output_dir, args.preset, tokenizer_vocab=args.tokenizer_vocab, dtype=dtype,
                         device=args.device, seed=args.seed)
    print(f"wrote {out}")


def _run_convert_native(args: argparse.Namespace) -> None:
    out = native_to_hf(args.src, args.out, family=args.family, dtype=args.dtype, rope_scaling_factor=args.rope_factor,
                       max_shard_size=args.max_shard_size, llama3_specials=args.llama3_specials)
    print(f"wrote {out}")


def _run_generate(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.run_generate(recipes.GenerateConfig.from_args(args))


def _run_chat(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.run_chat(recipes.ChatConfig.from_args(args))


def _run_calibrate(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.run_calibrate(recipes.CalibrateConfig.from_args(args))


def _run_demo(args: argparse.Namespace) -> None:
    recipes = _recipes()
    recipes.run_demo(recipes.DemoConfig.from_args(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``liger-models`` console script."""
    args = build_parser().parse_args(argv)
    if getattr(args, "device", None) == "cuda":
        # Checked before any work (the demo would first train a tokenizer and write its output directory).
        if not torch.cuda.is_available():
            print("liger-models: error: --device cuda was asked for but CUDA is not available", file=sys.stderr)
            return 2
    try:
        args.func(args)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError, ValueError,
            FloatingPointError, DiskFull) as exc:
        # User errors (bad paths, data, arguments; a gated Hub repo or a directory not writable; a loss that
        # diverged: "lower --lr?"; a full disk) get one clear line; LIGER_DEBUG=1 shows the traceback.
        if os.environ.get("LIGER_DEBUG"):
            raise
        print(f"liger-models: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("liger-models: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
