"""The recipes' settings: one dataclass per command, every option typed and documented, checked in one place.

``liger-models <command>`` parses its flags into these (a field per flag, the flag's name with ``_`` for ``-``),
and a Python caller builds them directly, by keyword (fields are keyword-only, so adding one never shifts another)::

    train_causal_lm(FinetuneConfig(model="runs/base", data=["train.jsonl"], max_steps=100))

``validate()`` refuses, before anything loads, what cannot work: missing files, options that contradict each other
or would be ignored without a word. Each recipe calls it first; the messages name the CLI flags, which are the
fields' names. The ranges the CLI parser enforces (``--lr`` > 0, ``--seq-len`` ≥ 2, ...) are in each field's comment.

A new option is a field here (its default is the flag's) plus the flag in cli.py: ``from_args`` maps one onto the
other by name and fails on a flag without a field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence, TypeVar

import torch

from liger_models.hub import ADAPTER_CONFIG, newest_run_checkpoint
from liger_models.lora.config import parse_indices
from liger_models.medusa.checkpoint import CONFIG_NAME, HEADS_NAME, LEGACY_HEADS_NAME, read_json
from liger_models.medusa.config import check_scheduler
from liger_models.medusa.vllm_format import VLLM_WEIGHTS_NAME
from liger_models.train import run_settings
from liger_models.train.bnb_optim import check_optimizer
from liger_models.train.trainer import refuse_cuda_graph_conflicts, refuse_in_backward_conflicts

_Config = TypeVar("_Config", bound="_FromArgs")
# What argparse adds to a command's namespace besides its options.
_PARSER_FIELDS = ("command", "func")


class _FromArgs:
    @classmethod
    def from_args(cls: type[_Config], args: argparse.Namespace) -> _Config:
        """The config of a parsed command line (cli.build_parser): every option becomes the field of its name."""
        return cls(**{k: v for k, v in vars(args).items() if k not in _PARSER_FIELDS})

    @classmethod
    def coerce(cls: type[_Config], config: _Config | argparse.Namespace) -> _Config:
        """``config`` itself, or the config of a parsed command line (the recipes' entry points take either)."""
        if isinstance(config, argparse.Namespace):
            return cls.from_args(config)
        if not isinstance(config, cls):  # e.g. a FinetuneConfig given to train_medusa: it has no Medusa fields
            raise TypeError(f"expected a {cls.__name__}, got {type(config).__name__}")
        return config


# ------------------------------------------------------------------------------------------------ training


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig(_FromArgs):
    """``liger-models train``: causal-LM fine-tuning (or pre-training) on packed sequences."""

    command: ClassVar[str] = "train"

    model: str  # model directory (HF format with tokenizer.json) or Hub repo id
    data: Sequence[str | os.PathLike]  # .txt (one document per file) or .jsonl ({"text"} or {"messages"} rows)
    eval_data: Sequence[str | os.PathLike] | None = None  # held-out files: evaluated every eval_every steps, at the end
    eval_every: int = 0  # ≥ 0; 0: evaluate only at the end
    eval_batches: int | None = None  # ≥ 1 eval micro-batches per process (None: TrainConfig.eval_batches)
    chat_template: str = "auto"  # auto | model | simple: how chat JSONL renders (loss on assistant turns only)
    data_cache: str | os.PathLike | None = None  # packed-data cache directory (None: OUTPUT_DIR/.data_cache)
    no_data_cache: bool = False  # tokenize every run, write no cache
    seq_len: int = 1024  # ≥ 2 tokens per packed sequence
    batch_size: int = 8  # ≥ 1 sequences per micro-batch per process
    grad_accum: int = 1  # ≥ 1 micro-batches per optimizer step
    max_steps: int = 1000  # ≥ 1 optimizer steps
    lr: float | None = None  # > 0 peak learning rate (None: peak_lr's default)
    warmup_steps: int | None = None  # ≥ 0 linear warmup steps, then cosine decay (None: 5% of max_steps)
    min_lr_ratio: float = 0.1  # in [0, 1]: final LR / peak LR of the cosine
    weight_decay: float = 0.0  # ≥ 0, AdamW's, on matrices only
    beta1: float = 0.9  # in [0, 1)
    beta2: float = 0.95  # in [0, 1)
    adam_eps: float = 1e-8  # > 0, AdamW's ε (added to √v)
    max_grad_norm: float = 1.0  # ≥ 0 gradient clipping; 0 disables
    optimizer_in_backward: bool = False  # step each parameter inside backward (needs max_grad_norm 0, grad_accum 1)
    cuda_graph: bool = False  # replay each whole step from one CUDA graph after 3 eager steps
    adamw: str = "liger"  # liger | torch: AdamW's CUDA step (this project's Triton kernel or torch's fused one)
    optimizer: str = "adamw"  # adamw, or bitsandbytes' adamw_8bit | paged_adamw_32bit | paged_adamw_8bit (bnb_optim.py)
    loss_scratch_mib: int | None = None  # ≥ 1: cap the fused linear-CE's logits scratch at this many MiB
    loss_grad_filter_eps: float | None = None  # in (0, 1): skip lm_head gradient columns below it (approximate)
    dtype: str = "auto"  # auto | bf16 | fp32 (auto: bf16 on CUDA, fp32 on CPU)
    device: str | None = None  # cuda | cpu (None: CUDA when available)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    mlp_chunk_tokens: int | None = None  # ≥ 1: each decoder layer's MLP in checkpointed chunks of this many rows
    output_dir: str | os.PathLike = "runs/train"  # metrics.jsonl and checkpoints/
    save_every: int = 500  # ≥ 0: checkpoint every N steps (and at the end; 0: only at the end)
    keep_last: int = 2  # ≥ 1 checkpoints kept
    resume: str | os.PathLike | None = None  # a checkpoint or run directory, or "auto": the newest in output_dir
    allow_changed_settings: str | None = None  # NAME,... (or all): settings a resume may change
    log_every: int = 10  # ≥ 1: a progress line every N steps
    seed: int = 0  # data order and initialisation
    quiet: bool = False  # no progress lines (metrics.jsonl is still written)
    lora_r: int | None = None  # ≥ 1: train LoRA adapters of this rank instead of the whole model (liger_models.lora)
    lora_alpha: float | None = None  # > 0 LoRA alpha (None: 2 × lora_r)
    lora_targets: str = "all-linear"  # all-linear, or comma-separated HF linear names (q_proj,v_proj,...)
    lora_dropout: float = 0.0  # in [0, 1): dropout on the adapters' input
    lora_rslora: bool = False  # scale by alpha/sqrt(r) (rsLoRA)
    lora_dora: bool = False  # DoRA: a trained magnitude per output row of each adapted linear
    lora_modules_to_save: str | None = None  # comma-separated: embed_tokens, lm_head, trained whole beside the adapters
    lora_layers: str | None = None  # decoder layers whose targets take adapters ("0-7,12"; PEFT's layers_to_transform)
    lora_token_rows: str | None = None  # token ids whose embedding rows train ("32000-32005"; trainable_token_indices)
    qlora: bool = False  # with lora_r: NF4 base weights, quantised on load

    def validate(self) -> None:
        """Refuse missing files and options that cannot go together, before anything is loaded: the Trainer would
        refuse some too, but only after the model and the data, minutes for a large model."""
        self._check_paths()
        self._check_options()

    def data_cache_dir(self) -> Path | None:
        """Where packed data is cached: ``data_cache``, else ``<output_dir>/.data_cache``; None: no_data_cache."""
        if self.no_data_cache:
            return None
        return Path(self.data_cache or Path(self.output_dir) / ".data_cache")

    def run_args(self) -> dict:
        """The options as a checkpoint's trainer_state.pt records them (JSON values), with the command."""
        def plain(value):
            if isinstance(value, os.PathLike):
                return str(value)
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        return {"command": self.command, **{f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}}

    def peak_lr(self) -> float:
        """--lr, else 2e-5 for the whole model, 2e-4 for LoRA adapters (their B starts at zero, and 2e-4 is the rate
        the QLoRA recipe and most LoRA fine-tunes train them at)."""
        return self.lr if self.lr is not None else (2e-4 if self.lora_r is not None else 2e-5)

    def resume_settings(self, *, dtype: str, world_size: int, lr: float) -> dict:
        """The options a resume must not change (train/run_settings.py), by their names there: ``dtype`` and ``lr``
        as resolved, the batch as the global one (``batch_size`` × processes)."""
        return {
            "seq-len": self.seq_len, "chat-template": self.chat_template, "batch-size": self.batch_size * world_size,
            "grad-accum": self.grad_accum, "lr": lr, "warmup-steps": self.warmup_steps,
            "min-lr-ratio": self.min_lr_ratio, "weight-decay": self.weight_decay, "beta1": self.beta1,
            "beta2": self.beta2, "adam-eps": self.adam_eps, "max-grad-norm": self.max_grad_norm, "dtype": dtype,
            "seed": self.seed,
            "loss-grad-filter-eps": self.loss_grad_filter_eps, "optimizer": self.optimizer,
            "lora": None if self.lora_r is None else {
                "r": self.lora_r, "alpha": self.lora_alpha, "targets": self.lora_targets,
                "dropout": self.lora_dropout, "rslora": self.lora_rslora, "qlora": self.qlora,
                "modules_to_save": self.lora_modules_to_save,
                # recorded only when set, so checkpoints written before the option existed still compare equal
                **({"dora": True} if self.lora_dora else {}),
                # as the layers it names, so "0-3" and "0,1,2,3" resume each other
                **({"layers": parse_indices(self.lora_layers)} if self.lora_layers is not None else {}),
                **({"token_rows": parse_indices(self.lora_token_rows, "token")}
                   if self.lora_token_rows is not None else {})},
        }

    def _check_paths(self) -> None:
        # Raised as the errors the CLI reports in one line with exit code 2, as for every other user error.
        for flag, paths in (("--data", self.data), ("--eval-data", self.eval_data or [])):
            for path in paths:
                p = Path(path)
                if not p.is_file():
                    raise FileNotFoundError(f"{flag} {path}: no such file")
                if p.suffix not in (".txt", ".jsonl"):
                    raise ValueError(f"{flag} {path}: expected a .txt or .jsonl file")
        self._check_heads()
        if self.resume not in (None, "auto") and not Path(self.resume).is_dir():
            raise FileNotFoundError(f"--resume {self.resume}: no such directory (or use 'auto')")
        # Refused now rather than after the model is loaded and the data tokenized (minutes for a large model).
        if Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise NotADirectoryError(f"--output-dir {self.output_dir}: a file, not a directory")

    def _check_heads(self) -> None:
        """Where the recipe starts from trained heads, that they are there (MedusaTrainingConfig)."""

    def _check_options(self) -> None:
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # what init_distributed will find
        # Options that would otherwise be ignored without a word.
        if self.lora_r is None and (self.qlora or self.lora_alpha is not None or self.lora_modules_to_save
                                    or self.lora_dora or self.lora_layers is not None
                                    or self.lora_token_rows is not None):
            raise ValueError("--qlora / --lora-alpha / --lora-dora / --lora-modules-to-save / --lora-layers / "
                             "--lora-token-rows train LoRA adapters: give --lora-r too")
        for flag, text, kind in (("--lora-layers", self.lora_layers, "layer"),
                                 ("--lora-token-rows", self.lora_token_rows, "token")):
            if text is not None:
                try:
                    parse_indices(text, kind)
                except ValueError as e:
                    raise ValueError(f"{flag}: {e}") from None
        if self.lora_r is not None and self.command not in ("train", "train-medusa"):
            raise ValueError(f"--lora-r is not supported by {self.command}")
        if self.data_cache and self.no_data_cache:
            raise ValueError("--data-cache DIR and --no-data-cache contradict each other; give one")
        if self.eval_every and not self.eval_data:
            raise ValueError("--eval-every needs --eval-data (the held-out files to evaluate on)")
        if self.eval_batches is not None and not self.eval_data:
            raise ValueError("--eval-batches needs --eval-data (the held-out files to evaluate on)")
        if self.allow_changed_settings is not None:
            if not self.resume:
                raise ValueError("--allow-changed-settings is for a resumed run: give --resume too")
            run_settings.parse_allowed(self.allow_changed_settings)
        if self.warmup_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} is longer than --max-steps {self.max_steps}: the "
                             "learning rate would never reach --lr")
        self._check_medusa_options()
        check_optimizer(self.optimizer, distributed=distributed, cuda_graph=self.cuda_graph, adamw=self.adamw)
        if self.optimizer_in_backward:
            refuse_in_backward_conflicts(self.grad_accum, self.max_grad_norm, distributed)
        if self.cuda_graph:
            self._check_cuda_graph_schedule()
            cpu = self.device == "cpu" or (self.device is None and not torch.cuda.is_available())
            refuse_cuda_graph_conflicts(cpu, distributed, self.optimizer_in_backward, self.activation_checkpointing,
                                        mlp_chunks=self.mlp_chunk_tokens is not None)

    def _check_medusa_options(self) -> None:
        """The Medusa recipe's own option checks (MedusaTrainingConfig)."""

    def _check_cuda_graph_schedule(self) -> None:
        """What --cuda-graph refuses in the Medusa recipe (MedusaTrainingConfig)."""


@dataclass(frozen=True, kw_only=True)
class MedusaTrainingConfig(FinetuneConfig):
    """``liger-models train-medusa``: Medusa heads (stage 1: frozen base) or heads + base (stage 2).

    Head k (1..K) predicts the token k+1 ahead with loss weight lambda0 · decay^k · schedule(step). The head-shape
    fields left None take MedusaConfig's defaults for fresh heads, and must match heads loaded from init_heads or a
    resumed checkpoint where given."""

    command: ClassVar[str] = "train-medusa"

    lr: float | None = None  # > 0 base LR; None: 2.5e-4 in stage 1 (heads at 1e-3), 2e-5 in stage 2 (2e-4 with lora_r)
    output_dir: str | os.PathLike = "runs/medusa"
    stage: int = 1  # 1: heads only (frozen base); 2: joint
    num_heads: int | None = None  # ≥ 1 Medusa heads (None: 5)
    num_layers: int | None = None  # ≥ 0 ResBlocks per head (None: 1)
    share_lm_head: bool | None = None  # project with the frozen base lm_head (Medusa "version 2")
    init_heads: str | os.PathLike | None = None  # start from trained heads (e.g. stage 2 from a stage-1 checkpoint)
    head_lr_multiplier: float = 4.0  # > 0: the heads' LR is lr × this
    schedule: str = "constant"  # heads' loss-weight warmup: constant | linear | sine | sine_<r>
    lambda0: float = 0.2  # ≥ 0 heads' loss coefficient
    decay: float = 0.8  # ≥ 0 per-head weight decay^k
    base_loss_weight: float | None = None  # ≥ 0 stage-2 weight of the base CE (None: 1; stage 1 has none)

    def peak_lr(self) -> float:
        return 2.5e-4 if self.lr is None and self.stage == 1 else super().peak_lr()

    def resume_settings(self, *, dtype: str, world_size: int, lr: float) -> dict:
        init = self.init_heads
        return {**super().resume_settings(dtype=dtype, world_size=world_size, lr=lr),
                "init-heads": str(Path(init).expanduser().resolve()) if init else None,
                "head-lr-multiplier": self.head_lr_multiplier, "schedule": self.schedule, "lambda0": self.lambda0,
                "decay": self.decay, "base-loss-weight": self.base_loss_weight}

    def _check_heads(self) -> None:
        if self.init_heads is not None:
            check_heads_dir(Path(self.init_heads), "--init-heads")

    def _check_medusa_options(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"--stage must be 1 or 2, got {self.stage}")
        check_scheduler(self.schedule)
        if self.stage == 1 and self.base_loss_weight is not None:
            raise ValueError("--base-loss-weight is for stage 2 only: stage 1 freezes the base and drops its loss")
        if self.stage == 1 and self.lora_r is not None:
            raise ValueError("--lora-r trains the base through adapters: that is stage 2 (--stage 2); stage 1 "
                             "freezes the base")

    def _check_cuda_graph_schedule(self) -> None:
        if self.schedule != "constant":
            raise ValueError(f"--cuda-graph needs --schedule constant: the heads' loss weights under "
                             f"{self.schedule!r} change every step, and a CUDA graph replays the weights it captured")


def check_heads_dir(path: Path, flag: str) -> None:
    """--init-heads / --medusa must hold Medusa heads: told now, by name, not after the base model has loaded (a
    base model's own directory, the easy mistake, has a config.json but no heads file)."""
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such directory")
    config = path / CONFIG_NAME
    missing = [] if config.is_file() else [CONFIG_NAME]
    # A vLLM-layout export keeps its heads in model.safetensors, as a base model does: its config says "medusa".
    vllm = config.is_file() and read_json(str(config)).get("model_type") == "medusa"
    files = (VLLM_WEIGHTS_NAME,) if vllm else (HEADS_NAME, LEGACY_HEADS_NAME)
    if not any((path / name).is_file() for name in files):
        missing.append(" (or ".join(files) + ")" * (len(files) - 1))
    if missing:
        raise FileNotFoundError(f"{flag} {path}: no Medusa heads there (missing {' and '.join(missing)})"
                                f"{newest_run_checkpoint(path)}; give a directory written by train-medusa, e.g. a "
                                "stage-1 checkpoint")


# ------------------------------------------------------------------------------------------------ decoding

# The processor options, generate's setting → (field, flag); left None, generation_config.json decides.
PROCESSOR_OPTIONS = {"repetition_penalty": ("repetition_penalty", "--repetition-penalty"),
                     "no_repeat_ngram_size": ("no_repeat_ngram_size", "--no-repeat-ngram-size"),
                     "min_new_tokens": ("min_new_tokens", "--min-new-tokens"), "stop_strings": ("stop", "--stop")}
# Their values that change nothing, the only ones Medusa tree decoding takes.
NEUTRAL_PROCESSOR_SETTINGS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}


@dataclass(frozen=True, kw_only=True)
class _Loading(_FromArgs):
    """Where and how a decoding command loads its models."""

    dtype: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: the checkpoint's)
    device: str | None = None  # cuda | cpu (None: CUDA when available)
    no_cuda_graph: bool = False  # on CUDA, decode every step eagerly

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype | None]:
        device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return device, {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]


@dataclass(frozen=True, kw_only=True)
class DecodingConfig(_Loading):
    """What ``generate`` and ``chat`` share: the models, the chat rendering, the sampling, the Medusa tree. Plain
    decoding takes what is left None from the checkpoint's generation_config.json, as HF's generate does."""

    model: str | None = None  # model directory or Hub id (None: the base --medusa's config names, or a stage-2 dir)
    medusa: str | os.PathLike | None = None  # Medusa heads (train-medusa, Medusa/TGI or vLLM format) or a stage-2 dir
    adapter: str | os.PathLike | None = None  # a PEFT LoRA adapter directory, attached to the base
    qlora_base: bool = False  # the base quantised to NF4 as it loads (what a --qlora adapter trained against)
    system: str | None = None  # a system turn opening the conversation
    chat_template: str | None = "auto"  # auto | model | simple (None: auto)
    max_new_tokens: int | None = None  # ≥ 1 (None: generation_config.json's budget, else 32)
    greedy: bool = False  # argmax decoding whatever generation_config.json says
    temperature: float | None = None  # > 0: sample (with --medusa: typical acceptance)
    top_k: int | None = None  # ≥ 0, plain decoding (0: no cut)
    top_p: float | None = None  # in (0, 1], plain decoding
    repetition_penalty: float | None = None  # > 0, plain decoding (1: none)
    no_repeat_ngram_size: int | None = None  # ≥ 0, plain decoding (0: off)
    min_new_tokens: int | None = None  # ≥ 0, plain decoding: no end-of-sequence before this many new tokens
    stop: Sequence[str] | None = None  # plain decoding: end the text at any of these strings
    seed: int = 0  # the sampling generator's seed
    default_tree: bool = False  # with --medusa: the default tree even where calibrate-tree saved one

    def validate(self) -> None:
        """Refuse, before anything loads, heads that are not there and options that contradict each other or
        would do nothing: each is a mistake worth a word."""
        if self.medusa is not None:
            check_heads_dir(Path(self.medusa).expanduser(), "--medusa")
        if self.adapter is not None and not (Path(self.adapter).expanduser() / ADAPTER_CONFIG).is_file():
            raise ValueError(f"--adapter {self.adapter}: no adapter_config.json there (a PEFT adapter directory, as "
                             f"`train --lora-r` checkpoints are){newest_run_checkpoint(Path(self.adapter).expanduser())}")
        self._check_decoding_options()

    def _check_decoding_options(self) -> None:
        if self.default_tree and self.medusa is None:
            raise ValueError("--default-tree chooses Medusa's tree: give --medusa")
        if self.greedy and (self.temperature, self.top_k, self.top_p) != (None, None, None):
            raise ValueError("--greedy contradicts --temperature / --top-k / --top-p: give one")
        self.sampling_settings(self.medusa is not None)  # refuses --top-k / --top-p with Medusa

    def processor_settings(self) -> dict:
        """generate's settings from the processor options given."""
        return {setting: getattr(self, field) for setting, (field, _) in PROCESSOR_OPTIONS.items()
                if getattr(self, field) is not None}

    def sampling_settings(self, medusa: bool) -> tuple[dict, dict]:
        """(settings for the decoding asked for, settings for --compare's plain decoding)."""
        processors = self.processor_settings()
        if medusa:
            if self.top_k is not None or self.top_p is not None:
                raise ValueError("--top-k / --top-p apply to plain decoding only: Medusa samples with typical "
                                 "acceptance (--temperature > 0)")
            changing = [PROCESSOR_OPTIONS[key][1] for key, value in processors.items()
                        if value != NEUTRAL_PROCESSOR_SETTINGS.get(key)]
            if changing:
                raise ValueError(f"{' / '.join(changing)}: Medusa tree decoding does not implement it (plain "
                                 "decoding does); only a neutral value (--repetition-penalty 1, --no-repeat-ngram-size "
                                 "0, --min-new-tokens 0) is taken, to override generation_config.json")
            temperature = 0.0 if self.greedy or self.temperature is None else self.temperature
            # --compare: plain decoding at the same temperature, without top-k / top-p cuts.
            plain = (dict(do_sample=False) if temperature == 0 else
                     dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0))
            return dict(temperature=temperature, **processors), {**plain, **processors}
        if self.greedy:
            return dict(do_sample=False, **processors), {}
        given = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        settings = {key: value for key, value in given.items() if value is not None}
        if settings:  # any of them asks for sampling (HF's generate would ignore them unless its config samples)
            settings["do_sample"] = True
        return {**settings, **processors}, {}


@dataclass(frozen=True, kw_only=True)
class ChatConfig(DecodingConfig):
    """``liger-models chat``: a conversation in the terminal, plain or with Medusa heads."""


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(DecodingConfig):
    """``liger-models generate``: decode prompts, plain or with Medusa heads, timed. ``system`` and
    ``chat_template`` shape chat prompts, so they need ``chat``."""

    chat_template: str | None = None  # auto | model | simple, with chat (None: auto)
    prompt: Sequence[str] | None = None  # prompts, each decoded on its own (or batch_size at a time)
    prompt_file: Sequence[str | os.PathLike] | None = None  # UTF-8 files whose whole text is one prompt each
    chat: bool = False  # each prompt is a user turn, rendered with the chat template
    compare: bool = False  # with medusa: also time plain decoding of each prompt (and check greedy tokens match)
    batch_size: int = 1  # ≥ 1 prompts per call, left-padded
    tree_tokens: int | None = None  # ≥ 0, with medusa: a batch's tree cut to this many tokens per call (0: no cut)

    def validate(self) -> None:
        for path in self.prompt_file or []:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--prompt-file {path}: no such file")
        super().validate()
        if self.compare and self.medusa is None:
            raise ValueError("--compare measures Medusa decoding against plain decoding: give --medusa")
        if self.tree_tokens is not None and self.medusa is None:
            raise ValueError("--tree-tokens cuts Medusa's tree: give --medusa")
        if not self.chat and (self.system is not None or self.chat_template is not None):
            raise ValueError("--system and --chat-template shape chat prompts: add --chat")
        if not self.prompt and not self.prompt_file:
            raise ValueError("give at least one --prompt or --prompt-file")


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig(_Loading):
    """``liger-models calibrate-tree``: a Medusa tree fitted to trained heads, saved next to them."""

    medusa: str | os.PathLike  # the heads directory (written into)
    data: Sequence[str | os.PathLike]  # held-out .txt/.jsonl files like the text the heads will decode
    model: str | None = None  # the base (None: the one the heads' config names)
    prompts: int = 32  # ≥ 1 prompts to decode
    prompt_tokens: int = 64  # ≥ 1 plain-text prompt length
    new_tokens: int = 128  # ≥ 1 greedy tokens per prompt
    size: int = 63  # ≥ 1 tree choices, root excluded
    chat_template: str = "auto"  # auto | model | simple, for chat .jsonl as in training

    def validate(self) -> None:
        for path in self.data:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--data {path}: no such file")
        check_heads_dir(Path(self.medusa).expanduser(), "--medusa")


# ------------------------------------------------------------------------------------------------ demo


@dataclass(frozen=True, kw_only=True)
class DemoConfig(_FromArgs):
    """``liger-models demo``: a small Llama pre-trained on the bundled text, then Medusa heads on it."""

    output_dir: str | os.PathLike = "runs/demo"  # where everything is written
    model: str | os.PathLike | None = None  # skip pre-training: train heads on this model directory
    quick: bool = False  # a tiny model and a few steps (seconds; for tests)
    pretrain_steps: int | None = None  # ≥ 0: override the pre-training steps
    medusa_steps: int | None = None  # ≥ 1: override the Medusa training steps
    device: str | None = None  # cuda | cpu (None: CUDA when available)
    seed: int = 0

    def validate(self) -> None:
        if self.model is not None and self.pretrain_steps is not None:  # it would be ignored without a word
            raise ValueError("--pretrain-steps is for the demo's own pre-training, which --model skips; give one of "
                             "them")
        if self.model is not None and not Path(self.model).is_dir():  # before an earlier demo's output is replaced
            raise FileNotFoundError(f"--model {self.model}: no such directory")
