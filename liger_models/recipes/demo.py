"""`liger-models demo`: from nothing to a Llama with trained Medusa heads on the bundled tiny-Shakespeare text.

1. Train a byte-level BPE tokenizer (2K vocab) on the first 95% of the text (the last 5% is held out).
2. Build a small Llama-architecture model (4 layers, hidden 256, 8 query / 2 key-value heads, tied embeddings) and
   pre-train it with the causal-LM recipe (`liger-models train`).
3. Train 3 Medusa heads on it with the stage-1 recipe (`liger-models train-medusa --stage 1`: base frozen).
4. Report, on the held-out text, each head's top-1 / top-5 accuracy before and after training (head k predicts the
   token k+1 ahead; chance is 1/vocab), a sampled continuation, and Medusa tree decoding's tokens per base-model
   forward (greedy, so its output equals plain greedy decoding) with the default tree and with a tree fitted to the
   trained heads on held-out text (`liger-models calibrate-tree`, saved next to them).

CPU: about 1 minute on 2 idle cores (the PyTorch reference path, fp32). GPU: the Triton kernels in bf16, more steps.
`--quick` shrinks everything to seconds (used by the tests). `--model DIR` skips steps 1–2.
"""

from __future__ import annotations

import argparse
import shutil
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from liger_models.auto import AutoLigerForCausalLM
from liger_models.hub import load_tokenizer
from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_models.medusa import MedusaModel, medusa_loss
from liger_models.medusa.calibrate import calibrate_medusa_choices, save_medusa_choices
from liger_models.medusa.decoding import medusa_generate
from liger_models.medusa.tree import default_medusa_choices
from liger_models.modules import shift_labels
from liger_models.recipes.configs import DemoConfig, FinetuneConfig, MedusaTrainingConfig
from liger_models.recipes.decoding import calibration_prompts
from liger_models.recipes.finetune import train_causal_lm
from liger_models.recipes.medusa import train_medusa
from liger_models.tokenizer import read_special_tokens
from liger_models.train.dataset import build_dataset
from liger_models.train.init_model import bundled_text, init_model_dir

MARKER = ".liger-demo"
NUM_HEADS = 3


@dataclass
class DemoSize:
    """Everything the demo's size depends on (medusa_lr is the heads' learning rate)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int
    batch: int
    pretrain_steps: int
    medusa_steps: int
    pretrain_lr: float
    medusa_lr: float
    text_chars: int | None = None


FULL_CPU = DemoSize(2048, 256, 4, 8, 2, 128, 16, 100, 50, 4e-3, 4e-3)
FULL_GPU = DemoSize(2048, 256, 4, 8, 2, 256, 32, 600, 200, 2e-3, 2e-3)
QUICK = DemoSize(320, 64, 2, 4, 2, 32, 4, 8, 6, 3e-3, 1e-3, text_chars=60_000)


def _prepare_output(out: Path, keep: Path | None = None) -> None:
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise FileExistsError(f"{out} exists and was not made by `liger-models demo`; pick another --output-dir")
        # --model may be an earlier demo's pre-trained model, the "base model:" path it printed: not deleted.
        kept = {keep.resolve(), *keep.resolve().parents} if keep is not None else set()
        for name in ("data", "base_init", "pretrain", "medusa"):
            if (out / name).resolve() not in kept:
                shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()


def _split_text(text: str, out: Path) -> tuple[Path, Path]:
    cut = text.rfind("\n\n", 0, int(len(text) * 0.95)) + 2  # hold out the last ~5%, cut at a speech boundary
    data = out / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text(text[:cut], encoding="utf-8")
    (data / "eval.txt").write_text(text[cut:], encoding="utf-8")
    return data / "train.txt", data / "eval.txt"


def _build_base(size: DemoSize, train_txt: Path, out: Path, seed: int) -> Path:
    return init_model_dir(out / "base_init", "demo", tokenizer_text=train_txt.read_text(encoding="utf-8"),
                          tokenizer_vocab=size.vocab, seed=seed, hidden_size=size.hidden,
                          intermediate_size=3 * size.hidden, num_hidden_layers=size.layers,
                          num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                          max_position_embeddings=max(1024, size.seq_len))


def _recipe_config(cls: type[FinetuneConfig], model: Path, data: Path, out: Path, size: DemoSize, steps: int,
                   lr: float, device: str | None, seed: int, **extra) -> FinetuneConfig:
    """A training recipe's config for one of the demo's runs: its size, few checkpoints, ten progress lines."""
    return cls(model=str(model), data=[str(data)], output_dir=str(out), seq_len=size.seq_len, batch_size=size.batch,
               max_steps=steps, lr=lr, warmup_steps=max(1, steps // 15), save_every=0, keep_last=1,
               log_every=max(1, steps // 10), seed=seed, device=device, **extra)


@torch.no_grad()
def evaluate_heads(medusa, eval_txt: Path, model_dir: Path, seq_len: int, device: torch.device,
                   max_windows: int = 32) -> dict:
    """Held-out top-1 / top-5 accuracy of the base model's next token and of every head (no logits formed)."""
    tokenizer = load_tokenizer(model_dir)
    dataset = build_dataset([eval_txt], tokenizer, read_special_tokens(tokenizer, model_dir), seq_len)
    batch = {k: v.to(device) for k, v in dataset.batch(torch.arange(min(len(dataset), max_windows))).items()}
    medusa.eval()
    hidden = medusa.base.model(batch["input_ids"], position_ids=batch["position_ids"])  # (B, T, H), one pass
    targets = shift_labels(batch["labels"], 1, batch["position_ids"])
    _, rank = fused_linear_cross_entropy(hidden, medusa.base.lm_head.weight, targets, return_target_rank=True)
    valid = (targets != -100).sum().clamp(min=1)
    heads = medusa_loss(hidden, medusa.heads, batch["labels"], position_ids=batch["position_ids"],
                        head_scales=[1.0] * medusa.heads.num_heads)
    count = heads.head_count.clamp(min=1)
    return {"base_top1": float((rank == 0).sum() / valid), "base_top5": float(((rank >= 0) & (rank < 5)).sum() / valid),
            "top1": (heads.head_top1 / count).tolist(), "top5": (heads.head_top5 / count).tolist(),
            "tokens": int(valid)}


def _sample(base, tokenizer, prompt: str, device: torch.device, n: int, seed: int) -> str:
    ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = base.generate(ids, max_new_tokens=n, do_sample=True, temperature=0.8, top_k=50, top_p=1.0, generator=gen)
    return tokenizer.decode(out[0].tolist())


def _medusa_speed(medusa, tokenizer, prompt: str, device: torch.device, n: int,
                  medusa_choices=None) -> tuple[float, bool]:
    """Mean tokens per base forward with Medusa tree decoding (greedy; the default tree unless ``medusa_choices``),
    and whether it equals plain greedy."""
    ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
    tokens, per_step = medusa_generate(medusa.base, medusa.heads, ids, max_new_tokens=n, eos_token_id=[],
                                       return_stats=True, medusa_choices=medusa_choices)
    greedy = medusa.base.generate(ids, max_new_tokens=n, eos_token_id=[], do_sample=False)
    same = torch.equal(tokens[0], greedy[0, : tokens.shape[1]])
    return sum(per_step) / len(per_step), same


def _fit_tree(medusa, tokenizer, model_dir: Path, eval_txt: Path, heads_dir: Path, quick: bool):
    """A tree fitted to the trained heads on greedy continuations of held-out text (`liger-models calibrate-tree`),
    saved next to them."""
    special = read_special_tokens(tokenizer, model_dir)
    prompts = calibration_prompts([eval_txt], tokenizer, special, count=4 if quick else 12, prompt_tokens=32)
    device = medusa.base.lm_head.weight.device
    calibration = calibrate_medusa_choices(medusa.base, medusa.heads, [torch.tensor(p, device=device) for p in prompts],
                                           new_tokens=32 if quick else 64)
    save_medusa_choices(heads_dir, calibration)
    return calibration


def _pct(values) -> str:
    return "  ".join(f"{v * 100:5.1f}%" for v in values)


def run_demo(config: DemoConfig | argparse.Namespace) -> dict:
    """Run the demo (see the module docstring); returns the numbers it prints. A parsed command line
    (cli.build_parser) is taken too, as its config."""
    config = DemoConfig.coerce(config)
    t0 = time.perf_counter()
    on_gpu = (config.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    size = QUICK if config.quick else (FULL_GPU if on_gpu else FULL_CPU)
    pretrain_steps = config.pretrain_steps if config.pretrain_steps is not None else size.pretrain_steps
    medusa_steps = config.medusa_steps or size.medusa_steps
    out = Path(config.output_dir)
    config.validate()
    _prepare_output(out, None if config.model is None else Path(config.model))
    text = bundled_text()[: size.text_chars]
    train_txt, eval_txt = _split_text(text, out)
    device = torch.device("cuda" if on_gpu else "cpu")
    print(f"liger-models demo on {device.type.upper()} → {out}", flush=True)

    if config.model is None:
        model_dir = _build_base(size, train_txt, out, config.seed)
        print(f"[1/3] tokenizer ({size.vocab} BPE tokens) and a {size.layers}-layer Llama (hidden {size.hidden}, "
              f"GQA {size.heads}/{size.kv_heads}) in {model_dir}", flush=True)
        if pretrain_steps:
            print(f"[2/3] pre-training for {pretrain_steps} steps of {size.batch}×{size.seq_len} tokens", flush=True)
            result = train_causal_lm(_recipe_config(FinetuneConfig, model_dir, train_txt, out / "pretrain", size,
                                                    pretrain_steps, size.pretrain_lr, config.device, config.seed))
            model_dir = result.checkpoint
    else:
        model_dir = Path(config.model)
        print(f"[1-2/3] using {model_dir}", flush=True)

    dtype = torch.bfloat16 if on_gpu else torch.float32
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(config.seed)
    fresh = MedusaModel.from_base(AutoLigerForCausalLM.from_pretrained(model_dir, dtype=dtype, device=device),
                                  num_heads=NUM_HEADS)
    before = evaluate_heads(fresh, eval_txt, model_dir, size.seq_len, device)
    del fresh

    print(f"[3/3] Medusa stage 1: {NUM_HEADS} heads for {medusa_steps} steps (base frozen)", flush=True)
    result = train_medusa(_recipe_config(MedusaTrainingConfig, model_dir, train_txt, out / "medusa", size,
                                         medusa_steps, size.medusa_lr / 4, config.device, config.seed, stage=1,
                                         num_heads=NUM_HEADS))
    medusa = MedusaModel.from_pretrained(str(result.checkpoint), dtype=dtype, device=device)
    after = evaluate_heads(medusa, eval_txt, model_dir, size.seq_len, device)

    prompt = "ROMEO:\n"
    sample = _sample(medusa.base, tokenizer, prompt, device, 24 if config.quick else 60, config.seed)
    speed, lossless = _medusa_speed(medusa, tokenizer, prompt, device, 16 if config.quick else 48)
    fitted = _fit_tree(medusa, tokenizer, model_dir, eval_txt, result.checkpoint, config.quick)
    fitted_speed, fitted_lossless = _medusa_speed(medusa, tokenizer, prompt, device, 16 if config.quick else 48,
                                                  fitted.medusa_choices)
    nodes = len(default_medusa_choices(NUM_HEADS)) + 1

    vocab = medusa.config.vocab_size
    print("\n=== results (held-out text, %d target tokens) ===" % after["tokens"])
    print(f"base model, next token: top-1 {after['base_top1'] * 100:.1f}%, top-5 {after['base_top5'] * 100:.1f}%"
          f"   (chance {100 / vocab:.2f}%)")
    print(f"{'':22}" + "  ".join(f"head{k + 1:>2} " for k in range(NUM_HEADS)) + "  (head k predicts token t+k+1)")
    print(f"top-1 before training: {_pct(before['top1'])}")
    print(f"top-1 after training:  {_pct(after['top1'])}")
    print(f"top-5 after training:  {_pct(after['top5'])}")
    print(f"Medusa tree decoding (greedy), tokens per base-model forward (1.00 = plain decoding): {speed:.2f} with "
          f"the default {nodes}-node tree, {fitted_speed:.2f} with "
          + ("it again (no tree fitted to the heads did better; calibrate-tree kept it)" if fitted.kept_default else
             f"a {len(fitted.medusa_choices) + 1}-node tree fitted to the heads (calibrate-tree)")
          + f"; output identical to greedy decoding: {lossless and fitted_lossless}")
    print(f"\nsample (temperature 0.8):\n{sample}\n")
    print(f"base model:   {model_dir}")
    print(f"Medusa heads: {result.checkpoint}  (Medusa/TGI format: config.json + medusa_lm_head.safetensors)")
    logs = [str(p) for p in (out / "pretrain" / "metrics.jsonl", out / "medusa" / "metrics.jsonl") if p.is_file()]
    print(f"metrics:      {', '.join(logs)}")
    print(f"decode:       liger-models generate --medusa {shlex.quote(str(result.checkpoint))} --prompt 'ROMEO:' "
          "--compare")
    print(f"total time:   {time.perf_counter() - t0:.0f}s")
    return {"before": before, "after": after, "tokens_per_step": speed, "lossless": lossless and fitted_lossless,
            "fitted_tokens_per_step": fitted_speed, "fitted_tree": fitted.medusa_choices,
            "model_dir": model_dir, "heads_dir": result.checkpoint, "sample": sample}
