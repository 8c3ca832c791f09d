"""Training recipes behind the CLI: causal-LM fine-tuning and Medusa stage 1 / stage 2.

Both build the same pieces in the same order: process group → ``--output-dir`` held (run_dir.py) → model (from
``--model``, or from the checkpoint when resuming) → activation checkpointing → FSDP2 → optimizer and schedule →
packed data → :class:`Trainer`.
A recipe takes an ``argparse.Namespace`` (see cli.py for every field) and returns the run's result.

Checkpoints are usable as they are: a causal-LM checkpoint is an HF model directory (with ``--model``'s tokenizer
files copied in, chat templates included: hub.TOKENIZER_PATTERNS); a Medusa stage-1 checkpoint is a heads directory
in the Medusa/TGI format whose ``base_model_name_or_path`` is ``--model`` (the tokenizer files beside it too); a
stage-2 checkpoint holds the trained base plus the heads. Which chat template the data's conversations render with
(the model's own, from which file, or the built-in one) is logged before the data is read.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from liger_models.train import checkpointing as ckpt
from liger_models.train import data_cache
from liger_models.train import distributed as D
from liger_models.train import run_dir
from liger_models.train import run_settings
from liger_models.train.data import (BatchStream, PackedDataset, build_dataset, chat_template_note,
                                     read_special_tokens)
from liger_models.train.interrupt import Interrupted, StopOnSignal
from liger_models.train.optim import build_adamw, build_scheduler, decay_param_groups
from liger_models.train.trainer import (CausalLMTask, MedusaTask, TrainConfig, Trainer, refuse_cuda_graph_conflicts,
                                        refuse_in_backward_conflicts)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class RunResult:
    """What a recipe leaves behind: the last checkpoint directory and the per-step metrics of this session."""

    checkpoint: Path | None
    history: list[dict] = field(default_factory=list)
    output_dir: Path | None = None
    evals: list[dict] = field(default_factory=list)  # eval-set results of this session (--eval-data)
    stopped_by: int = 0  # the signal that stopped the run early, checkpointed (interrupt.py); 0: it ran to the end


def resolve_model_dir(model: str) -> Path:
    """A local model directory, or the local snapshot of a Hub repo id (downloaded if needed)."""
    from liger_models.hub import resolve_dir, snapshot

    path = Path(model).expanduser()
    if path.exists():
        return resolve_dir(path)
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"--model {model!r}: no such directory (and not a Hub repo id)")
    return snapshot(model)


def _dtype_name(args: argparse.Namespace, device: torch.device) -> str:
    return args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")


def _dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    return DTYPES[_dtype_name(args, device)]


def _check_vocab(dataset, vocab_size: int) -> None:
    top = int(dataset.input_ids.max())
    if top >= vocab_size:
        raise ValueError(f"the tokenizer produced token id {top}, but the model's vocab_size is {vocab_size} "
                         "(tokenizer and model do not belong together)")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The --model's tokenizer files (hub.TOKENIZER_PATTERNS: chat templates included) into a checkpoint, and its
    generation_config.json where the save wrote none (a stage-1 heads directory), so the checkpoint decodes,
    chats and trains further as the model it came from."""
    from liger_models.hub import GENERATION_CONFIG, copy_tokenizer_files

    copy_tokenizer_files(src, dst)
    if (src / GENERATION_CONFIG).is_file() and not (dst / GENERATION_CONFIG).exists():
        shutil.copy2(src / GENERATION_CONFIG, dst / GENERATION_CONFIG)


def _shadow_base(base: nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> nn.Module:
    """A CPU model holding ``state`` (gathered FSDP weights), built on meta so nothing is allocated twice."""
    from liger_models import AutoLigerForCausalLM

    shadow = AutoLigerForCausalLM.from_config(base.config, device="meta")
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    shadow.load_state_dict(sub, strict=False, assign=True)
    shadow.tie_weights()
    return shadow


def _check_materialised(module: nn.Module) -> None:
    meta = [k for k, v in module.state_dict(keep_vars=True).items() if v.is_meta]
    if meta:
        raise RuntimeError(f"gathered checkpoint state is missing tensors: {meta[:5]}")


def check_options(args: argparse.Namespace) -> None:
    """Refuse options that cannot go together before anything is loaded: the Trainer would refuse them too, but
    only after the model and the data, minutes for a large model."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # what init_distributed will find
    # Options that would otherwise be ignored without a word.
    if getattr(args, "data_cache", None) and getattr(args, "no_data_cache", False):
        raise ValueError("--data-cache DIR and --no-data-cache contradict each other; give one")
    if args.eval_every and not args.eval_data:
        raise ValueError("--eval-every needs --eval-data (the held-out files to evaluate on)")
    if args.eval_batches is not None and not args.eval_data:
        raise ValueError("--eval-batches needs --eval-data (the held-out files to evaluate on)")
    if getattr(args, "allow_changed_settings", None) is not None:
        if not args.resume:
            raise ValueError("--allow-changed-settings is for a resumed run: give --resume too")
        run_settings.parse_allowed(args.allow_changed_settings)
    if args.warmup_steps is not None and args.warmup_steps > args.max_steps:
        raise ValueError(f"--warmup-steps {args.warmup_steps} is longer than --max-steps {args.max_steps}: the "
                         "learning rate would never reach --lr")
    if getattr(args, "stage", 2) == 1 and args.base_loss_weight is not None:
        raise ValueError("--base-loss-weight is for stage 2 only: stage 1 freezes the base and drops its loss")
    if args.optimizer_in_backward:
        refuse_in_backward_conflicts(args.grad_accum, args.max_grad_norm, distributed)
    if args.cuda_graph:
        if getattr(args, "schedule", "constant") != "constant":
            raise ValueError(f"--cuda-graph needs --schedule constant: the heads' loss weights under "
                             f"{args.schedule!r} change every step, and a CUDA graph replays the weights it captured")
        cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
        refuse_cuda_graph_conflicts(cpu, distributed, args.optimizer_in_backward, args.activation_checkpointing)


def _say(message: str) -> None:
    """A line on stderr for the user, --quiet or not: where a run resumes from, what it found wrong on the way."""
    print(f"liger-models: {message}", file=sys.stderr, flush=True)


def _on_main(info: D.DistInfo, decide: Callable[[], object]):
    """``decide()`` on rank 0 and its result on every rank, or the exception it raised raised on every rank (the
    others would otherwise wait for rank 0 forever)."""
    result, failure = None, None
    if info.is_main:
        try:
            result = decide()
        except Exception as exc:
            failure = exc
    result, failure = D.broadcast_object((result, failure))
    if failure is not None:
        raise failure
    return result


def _setup(args: argparse.Namespace):
    info = D.init_distributed(args.device)
    torch.manual_seed(args.seed)
    resume = _on_main(info, lambda: _find_resume(args))
    return info, resume


def _find_resume(args: argparse.Namespace) -> Path | None:
    """The checkpoint to resume from (checked: intact, written by this command), saying on the way which damaged
    ones were passed over; None for a fresh run. On rank 0 only: verifying reads every file of a checkpoint."""
    if not args.resume:
        existing = ckpt.find_latest(Path(args.output_dir) / "checkpoints")
        if existing is not None:
            raise ValueError(f"{args.output_dir} already holds checkpoints ({existing.name}); continue with "
                             "--resume auto, or choose another --output-dir")
        return None
    found = ckpt.find_resumable(args.resume, args.output_dir)
    for path, why in found.damaged:
        _say(f"warning: checkpoint {path} is damaged: {why}; resuming from {found.checkpoint.name}, the newest "
             "intact one before it")
    if found.checkpoint is not None:
        if not found.verified:
            _say(f"note: {found.checkpoint} has no {ckpt.MANIFEST_FILE} (written before checkpoints carried one): "
                 "its files are not verified")
        _check_resume_kind(found.checkpoint, args)
    return found.checkpoint


def _run_kind(stage: int | None) -> str:
    return "liger-models train" if stage is None else f"liger-models train-medusa --stage {stage}"


_UNKNOWN = "unknown"


def _check_resume_kind(checkpoint: Path, args: argparse.Namespace) -> None:
    """Refuse a checkpoint of another command or Medusa stage, told apart by its files: a Medusa checkpoint holds
    a heads file, a stage-2 one a full model config beside it. Resumed across kinds, the optimizer state did not fit
    (a traceback), or stage 1 dropped the stage-2 base without a word and overwrote the run's checkpoints. Files that
    disagree with the command its trainer_state.pt records are a damaged checkpoint (a heads file lost), not another
    command's."""
    found = _kind_by_files(checkpoint)
    recorded = _recorded_kind(checkpoint)
    if recorded not in (_UNKNOWN, found):
        raise ValueError(f"--resume: checkpoint {checkpoint} is damaged: it was written by "
                         f"`{_run_kind(recorded)}`, but {_wrong_files(found)}")
    wanted = getattr(args, "stage", None)
    if found != wanted:
        hint = (f"; stage 2 starts from stage-1 heads with --init-heads {checkpoint} and another --output-dir"
                if (found, wanted) == (1, 2) else "")
        raise ValueError(f"--resume: {checkpoint} was written by `{_run_kind(found)}`, not `{_run_kind(wanted)}`: "
                         f"resume it with that command, or choose another --output-dir{hint}")


def _kind_by_files(checkpoint: Path) -> int | None:
    """The Medusa stage whose files ``checkpoint`` holds; None: a causal LM's."""
    from liger_models.medusa.checkpoint import CONFIG_NAME, HEADS_NAME, LEGACY_HEADS_NAME, read_json

    if not any((checkpoint / name).is_file() for name in (HEADS_NAME, LEGACY_HEADS_NAME)):
        return None
    config = checkpoint / CONFIG_NAME
    return 2 if config.is_file() and "model_type" in read_json(str(config)) else 1


def _wrong_files(found: int | None) -> str:
    from liger_models.medusa.checkpoint import HEADS_NAME

    if found is None:
        return f"{HEADS_NAME} is missing"
    return f"its files are those of `{_run_kind(found)}`"


def _recorded_kind(checkpoint: Path) -> int | None | str:
    """The Medusa stage (None: `train`) that trainer_state.pt records as having written ``checkpoint``; _UNKNOWN
    where it records no command."""
    recorded = ckpt.load_trainer_state(checkpoint, mmap=True).get("args") or {}
    if recorded.get("command") == "train":
        return None
    if recorded.get("command") == "train-medusa" and recorded.get("stage") in (1, 2):
        return recorded["stage"]
    return _UNKNOWN


def _settings(args, info: D.DistInfo, model_dir: Path, resume: Path | None, lr: float
              ) -> tuple[dict, list[run_settings.Change]]:
    """This run's settings (run_settings.py) and, resuming, how they differ from the checkpoint's (all allowed by
    --allow-changed-settings: a difference that is not raises)."""

    def decide():
        settings = run_settings.collect(args, model=_base_name(args.model), model_dir=model_dir,
                                        dtype=_dtype_name(args, info.device), world_size=info.world_size, lr=lr)
        if resume is None:
            return settings, []
        recorded = ckpt.load_trainer_state(resume, mmap=True).get("settings")
        if recorded is None:
            _say(f"note: {resume} records no run settings (written by an earlier version): this run's are not "
                 "checked against it")
            return settings, []
        allowed = run_settings.parse_allowed(getattr(args, "allow_changed_settings", None))
        return settings, run_settings.check(recorded, settings, allowed, resume)

    return _on_main(info, decide)


def data_cache_dir(args) -> Path | None:
    """Where packed data is cached: ``--data-cache``, else ``<output_dir>/.data_cache``; None with --no-data-cache."""
    if getattr(args, "no_data_cache", False):
        return None
    return Path(getattr(args, "data_cache", None) or Path(args.output_dir) / ".data_cache")


def _data(args, model_dir: Path, vocab_size: int, info: D.DistInfo) -> tuple[BatchStream, PackedDataset | None]:
    """The training stream and the packed eval data (None without --eval-data), tokenized alike."""
    from liger_models.hub import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    special = read_special_tokens(tokenizer, model_dir)
    note = chat_template_note(special, args.chat_template)  # refuses --chat-template model without a template
    if info.is_main and not args.quiet:
        print(note, flush=True)

    cache = data_cache_dir(args)

    def packed(paths) -> PackedDataset:
        def build() -> PackedDataset:
            return build_dataset(paths, tokenizer, special, args.seq_len, args.chat_template, cache_dir=cache)

        if cache is not None and info.distributed:
            # Rank 0 tokenizes and writes the cache; the others wait, then load what it wrote.
            dataset = build() if info.is_main else None
            D.barrier()
            dataset = dataset if info.is_main else build()
        else:
            dataset = build()
        _check_vocab(dataset, vocab_size)
        return dataset

    stream = BatchStream(packed(args.data), args.batch_size, seed=args.seed, rank=info.rank, world_size=info.world_size)
    return stream, packed(args.eval_data) if args.eval_data else None


def _finish(args, info, model, task, data, groups, export, resume, settings_and_changes) -> RunResult:
    """Build the optimizer, schedule and Trainer, resume, train. ``settings_and_changes``: this run's settings, and
    how they differ from the resumed checkpoint's (allowed ones: _settings)."""
    stream, eval_data = data
    settings, changes = settings_and_changes
    optimizer = build_adamw(groups, betas=(args.beta1, args.beta2), capturable=args.cuda_graph,
                            kernel=getattr(args, "adamw", "liger") == "liger")
    warmup = args.warmup_steps if args.warmup_steps is not None else args.max_steps // 20
    scheduler = build_scheduler(optimizer, warmup, args.max_steps, args.min_lr_ratio)
    config = TrainConfig(output_dir=args.output_dir, max_steps=args.max_steps, grad_accum=args.grad_accum,
                         max_grad_norm=args.max_grad_norm, log_every=args.log_every, save_every=args.save_every,
                         keep_last=args.keep_last, quiet=args.quiet,
                         optimizer_in_backward=args.optimizer_in_backward, cuda_graph=args.cuda_graph,
                         eval_every=args.eval_every, eval_batches=args.eval_batches or TrainConfig.eval_batches)
    run_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    trainer = Trainer(model, task, stream, optimizer, scheduler, config, info, export, run_args, eval_data,
                      settings=settings)
    if resume is not None:
        trainer.resume(resume)
        if info.is_main and not args.quiet:
            print(f"resumed from {resume} at step {trainer.step}", flush=True)
    if changes:
        _go_on_with(changes, args, trainer, resume)
    start = time.perf_counter()
    with (_loss_options(getattr(args, "loss_scratch_mib", None), getattr(args, "loss_grad_filter_eps", None)),
          StopOnSignal(announce=info.is_main) as stop):
        trainer.stop_signal = lambda: stop.signum
        history = trainer.train()
    last = ckpt.find_latest(Path(args.output_dir) / "checkpoints")
    if info.is_main and not args.quiet and not trainer.stopped_by:
        print(f"done: {trainer.step} steps in {time.perf_counter() - start:.1f}s; checkpoint: {last}", flush=True)
    return RunResult(last, history, Path(args.output_dir), trainer.evals, trainer.stopped_by)


def _go_on_with(changes: list[run_settings.Change], args, trainer: Trainer, resume: Path) -> None:
    """Continue with changed settings that --allow-changed-settings let through: said now, logged with the first
    resumed step. The model, optimizer and batches already take this run's options; the data order's seed is the
    one the checkpoint restored, unless --seed is among the changes."""
    if trainer.info.is_main:
        _say(f"resuming {resume} at step {trainer.step} with changed settings (--allow-changed-settings): "
             f"{run_settings.describe(changes)}")
    trainer.settings_changed = run_settings.logged(changes)
    if any(c.name == "seed" for c in changes):
        trainer.stream.load_state_dict({**trainer.stream.state_dict(), "seed": args.seed})


@contextlib.contextmanager
def _loss_options(scratch_mib: int | None, grad_filter_eps: float | None = None):
    """--loss-scratch-mib and --loss-grad-filter-eps: linear-CE's max_scratch_bytes and grad_filter_eps settings for
    the run (every head's loss), then the defaults again."""
    from liger_models.kernels import fused_linear_cross_entropy as flce
    from liger_models.kernels._tuning import tuned

    changes = {}
    if scratch_mib is not None:
        changes["max_scratch_bytes"] = scratch_mib << 20
    if grad_filter_eps is not None:
        changes["grad_filter_eps"] = grad_filter_eps
    with tuned(flce, **changes):
        yield


def _prepare(model: nn.Module, layers, args, info, more_units=()) -> None:
    """Activation checkpointing on ``layers``; under torchrun, FSDP2 units = ``layers`` + ``more_units``."""
    if args.activation_checkpointing:
        D.apply_activation_checkpointing(layers)
    if info.distributed:
        D.apply_fsdp(model, [*layers, *more_units], info.device)


def _in_process_group(run: Callable[[], RunResult], args: argparse.Namespace) -> RunResult:
    """Join the process group, hold ``--output-dir`` (run_dir.claimed: one run at a time, what killed writers left
    cleared), ``run()`` (which builds the model, FSDP units and optimizer, and trains), then leave the group.
    Everything run() built is freed before leaving, here on the main thread: FSDP modules hold the process group,
    and left alive (some in reference cycles) they would destroy its gloo connections later, from whatever thread
    next triggers a garbage collection, which aborts the process at exit ("terminate called without an active
    exception"; seen about one 2-process CPU run in six on a loaded machine). A run stopped by a signal raises
    :class:`Interrupted` only then, once every rank has left the group as after a finished run."""
    try:
        info = D.init_distributed(args.device)
        with run_dir.claimed(args.output_dir, info, data_cache_dir(args)), data_cache.digests_remembered():
            result = run()
    except BaseException:
        D.destroy_distributed(clean=False)  # a barrier could wait forever for a rank that died
        raise
    gc.collect()
    D.destroy_distributed(clean=True)
    if result.stopped_by:
        raise Interrupted(result.stopped_by, result.checkpoint)
    return result


def train_causal_lm(args: argparse.Namespace) -> RunResult:
    """Fine-tune (or pre-train) a causal LM on ``args.data``; see the module docstring."""
    from liger_models import AutoLigerForCausalLM

    check_options(args)

    def run() -> RunResult:
        info, resume = _setup(args)
        model_dir = resolve_model_dir(args.model)
        settings = _settings(args, info, model_dir, resume, args.lr)
        dtype = _dtype(args, info.device)
        model = AutoLigerForCausalLM.from_pretrained(resume or model_dir, dtype=dtype, device=info.device)
        stream, eval_data = _data(args, model_dir, model.config.vocab_size, info)
        _prepare(model, model.model.layers, args, info)
        groups = decay_param_groups(model, args.lr, args.weight_decay)

        def export(directory: Path, full_state: dict | None, final: Path) -> None:
            target = model if full_state is None else _shadow_base(model, full_state)
            if full_state is not None:
                _check_materialised(target)
            target.save_pretrained(directory)
            _copy_tokenizer(model_dir, directory)

        return _finish(args, info, model, CausalLMTask(), (stream, eval_data), groups, export, resume, settings)

    return _in_process_group(run, args)


def _base_name(model: str) -> str:
    # Written into the heads' config.json: an absolute path finds the base from anywhere; a Hub id stays one.
    return os.path.abspath(model) if Path(model).expanduser().exists() else model


def _medusa_model(args, model_dir: Path, dtype, device, resume: Path | None):
    from liger_models import AutoLigerForCausalLM
    from liger_models.medusa import MedusaModel

    def with_this_runs_loss(medusa):
        # The loss settings are this run's (stage 2 usually changes the schedule), not the saved heads', whether the
        # heads come from --init-heads or from the checkpoint being resumed (which saved the same settings). So is
        # the base that stage-1 heads name: the one they are trained on, --model.
        medusa.config.heads_coefficient, medusa.config.decay_coefficient = args.lambda0, args.decay
        medusa.config.scheduler, medusa.config.base_loss_weight = args.schedule, args.base_loss_weight
        if args.stage == 1:
            medusa.config.base_model_name_or_path = _base_name(args.model)
        return medusa

    # The head-shape options given (None: not given); fresh heads take MedusaConfig's defaults for the others.
    shape = {k: v for k, v in (("num_heads", args.num_heads), ("num_layers", args.num_layers),
                               ("share_lm_head", args.share_lm_head)) if v is not None}

    def loaded(medusa, flag: str, directory):
        # The heads' shape is the file's: a shape option given that disagrees would be ignored without a word.
        for name, given in shape.items():
            value = getattr(medusa.config, name)
            if given != value:
                option = "--" + name.replace("_", "-")
                shown = option if isinstance(given, bool) else f"{option} {given}"
                raise ValueError(f"{shown} disagrees with the heads of {flag} {directory} ({name}: {value}); "
                                 f"drop it, or train new heads without {flag}")
        return with_this_runs_loss(medusa)

    if resume is not None and args.stage == 2:
        medusa = MedusaModel.from_pretrained(str(resume), dtype=dtype, device=device, stage=2, load_tree=False)
        return loaded(medusa, "--resume", resume)
    base = AutoLigerForCausalLM.from_pretrained(model_dir, dtype=dtype, device=device)
    heads_dir = resume or args.init_heads
    if heads_dir is not None:
        medusa = MedusaModel.from_pretrained(str(heads_dir), base=base, dtype=dtype, device=device,
                                             stage=args.stage, load_tree=False)
        return loaded(medusa, "--resume" if resume else "--init-heads", heads_dir)
    return MedusaModel.from_base(
        base, stage=args.stage, **shape, base_model_name_or_path=_base_name(args.model),
        heads_coefficient=args.lambda0, decay_coefficient=args.decay, scheduler=args.schedule,
        base_loss_weight=args.base_loss_weight,
    )


def train_medusa(args: argparse.Namespace) -> RunResult:
    """Train Medusa heads (stage 1: frozen base) or heads + base (stage 2); see the module docstring."""
    from liger_models.medusa import MedusaHeads, MedusaModel

    check_options(args)

    def run() -> RunResult:
        info, resume = _setup(args)
        model_dir = resolve_model_dir(args.model)
        lr = args.lr if args.lr is not None else (2.5e-4 if args.stage == 1 else 2e-5)
        settings = _settings(args, info, model_dir, resume, lr)
        dtype = _dtype(args, info.device)
        medusa = _medusa_model(args, model_dir, dtype, info.device, resume)
        stream, eval_data = _data(args, model_dir, medusa.config.vocab_size, info)
        _prepare(medusa, medusa.base.model.layers, args, info, more_units=medusa.heads)
        # --weight-decay is on matrices only, as for the causal LM: not on the heads' biases nor the base's norms.
        groups = medusa.param_groups(lr, args.head_lr_multiplier, args.weight_decay)  # no decay on 1-D

        def export(directory: Path, full_state: dict | None, final: Path) -> None:
            target = medusa
            if full_state is not None:
                base = _shadow_base(medusa.base, full_state, prefix="base.")
                heads = MedusaHeads(medusa.config, base.lm_head, device="meta")
                heads.load_state_dict({k[len("heads."):]: v for k, v in full_state.items()
                                       if k.startswith("heads.")}, strict=True, assign=True)
                target = MedusaModel(base, heads, stage=medusa.stage)
                _check_materialised(target.heads if medusa.stage == 1 else target)
            target.save_pretrained(str(directory), location=str(final))
            _copy_tokenizer(model_dir, directory)

        task = MedusaTask(medusa.config.num_heads)
        return _finish(args, info, medusa, task, (stream, eval_data), groups, export, resume, settings)

    return _in_process_group(run, args)
