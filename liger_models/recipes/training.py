"""What the training recipes share (finetune.py: causal LM; medusa.py: Medusa stage 1 / stage 2).

Both build the same pieces in the same order: process group → ``--output-dir`` held (run_dir.py) → model (from
``--model``, or from the checkpoint when resuming) → activation checkpointing → FSDP2 → optimizer and schedule →
packed data → :class:`Trainer`.
A recipe takes its config (configs.py: :class:`FinetuneConfig`, :class:`MedusaTrainingConfig`) and returns the run's
:class:`RunResult`.

Checkpoints are usable as they are: a causal-LM checkpoint is an HF model directory (with ``--model``'s tokenizer
files copied in, chat templates included: hub.TOKENIZER_PATTERNS); a Medusa stage-1 checkpoint is a heads directory
in the Medusa/TGI format whose ``base_model_name_or_path`` is ``--model`` (the tokenizer files beside it too); a
stage-2 checkpoint holds the trained base plus the heads. Which chat template the data's conversations render with
(the model's own, from which file, or the built-in one) is logged before the data is read.
"""

from __future__ import annotations

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

from liger_models.auto import AutoLigerForCausalLM
from liger_models.hub import GENERATION_CONFIG, copy_tokenizer_files, load_tokenizer
from liger_models.kernels.ops import fused_linear_cross_entropy as flce
from liger_models.kernels._tuning import tuned
from liger_models.lora import add_lora, lora_modules, lora_state_dict
from liger_models.lora.peft_format import CONFIG_NAME as ADAPTER_CONFIG_NAME
from liger_models.medusa.checkpoint import CONFIG_NAME, HEADS_NAME, LEGACY_HEADS_NAME, read_json
from liger_models.modules.decoder import chunk_mlps
from liger_models.recipes.configs import FinetuneConfig, MedusaTrainingConfig
from liger_models.tokenizer import read_special_tokens
from liger_models.text.chat import chat_template_note
from liger_models.train import checkpointing as ckpt
from liger_models.train import data_cache
from liger_models.train import distributed as D
from liger_models.train import run_dir
from liger_models.train import run_settings
from liger_models.train.batches import BatchStream
from liger_models.train.dataset import build_dataset
from liger_models.train.interrupt import Interrupted, StopOnSignal
from liger_models.train.optim import build_optimizer, build_scheduler, trained_embeddings
from liger_models.train.packing import PackedDataset
from liger_models.train.trainer import TrainConfig, Trainer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class RunResult:
    """What a recipe leaves behind: the last checkpoint directory and the per-step metrics of this session."""

    checkpoint: Path | None
    history: list[dict] = field(default_factory=list)
    output_dir: Path | None = None
    evals: list[dict] = field(default_factory=list)  # eval-set results of this session (--eval-data)
    stopped_by: int = 0  # the signal that stopped the run early, checkpointed (interrupt.py); 0: it ran to the end


def dtype_name(config: FinetuneConfig, device: torch.device) -> str:
    return config.dtype if config.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")


def dtype_of(config: FinetuneConfig, device: torch.device) -> torch.dtype:
    return DTYPES[dtype_name(config, device)]


def _check_vocab(dataset, vocab_size: int) -> None:
    top = int(dataset.input_ids.max())
    if top >= vocab_size:
        raise ValueError(f"the tokenizer produced token id {top}, but the model's vocab_size is {vocab_size} "
                         "(tokenizer and model do not belong together)")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The --model's tokenizer files (hub.TOKENIZER_PATTERNS: chat templates included) into a checkpoint, and its
    generation_config.json where the save wrote none (a stage-1 heads directory), so the checkpoint decodes,
    chats and trains further as the model it came from."""
    copy_tokenizer_files(src, dst)
    if (src / GENERATION_CONFIG).is_file() and not (dst / GENERATION_CONFIG).exists():
        shutil.copy2(src / GENERATION_CONFIG, dst / GENERATION_CONFIG)


def shadow_base(base: nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> nn.Module:
    """A CPU model holding ``state`` (gathered FSDP weights), built on meta so nothing is allocated twice. Where
    ``base`` carries LoRA adapters the shadow carries the same ones, and ``state`` may hold only what trains (the
    frozen base then stays on meta: an adapter checkpoint does not hold it)."""
    shadow = AutoLigerForCausalLM.from_config(base.config, device="meta")
    if lora_modules(base):
        add_lora(shadow, base.lora_settings)
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    shadow.load_state_dict(sub, strict=False, assign=True)
    shadow.tie_weights()
    # A decoder of a multimodal checkpoint: its save (or adapter) is the whole checkpoint's, as on one process
    shadow.checkpoint_wrapper = getattr(base, "checkpoint_wrapper", None)
    return shadow


def check_materialised(module: nn.Module) -> None:
    """Every tensor a checkpoint of ``module`` holds came with the gathered state: its whole state dict, or for a
    model with LoRA adapters what its adapter file holds."""
    tensors = lora_state_dict(module) if lora_modules(module) else module.state_dict(keep_vars=True)
    meta = [k for k, v in tensors.items() if v.is_meta]
    if meta:
        raise RuntimeError(f"gathered checkpoint state is missing tensors: {meta[:5]}")


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


def setup(config: FinetuneConfig):
    """(this process's DistInfo, the checkpoint to resume from or None), the seed set."""
    info = D.init_distributed(config.device)
    torch.manual_seed(config.seed)
    resume = _on_main(info, lambda: _find_resume(config))
    return info, resume


def _find_resume(config: FinetuneConfig) -> Path | None:
    """The checkpoint to resume from (checked: intact, written by this command), saying on the way which damaged
    ones were passed over; None for a fresh run. On rank 0 only: verifying reads every file of a checkpoint."""
    if not config.resume:
        existing = ckpt.find_latest(Path(config.output_dir) / "checkpoints")
        if existing is not None:
            raise ValueError(f"{config.output_dir} already holds checkpoints ({existing.name}); continue with "
                             "--resume auto, or choose another --output-dir")
        return None
    found = ckpt.find_resumable(config.resume, config.output_dir)
    for path, why in found.damaged:
        _say(f"warning: checkpoint {path} is damaged: {why}; resuming from {found.checkpoint.name}, the newest "
             "intact one before it")
    if found.checkpoint is not None:
        if not found.verified:
            _say(f"note: {found.checkpoint} has no {ckpt.MANIFEST_FILE} (written before checkpoints carried one): "
                 "its files are not verified")
        _check_resume_kind(found.checkpoint, _stage(config))
    return found.checkpoint


def _stage(config: FinetuneConfig) -> int | None:
    """The Medusa stage a config trains; None: a causal LM (`train`)."""
    return config.stage if isinstance(config, MedusaTrainingConfig) else None


def _run_kind(stage: int | None) -> str:
    return "liger-models train" if stage is None else f"liger-models train-medusa --stage {stage}"


_UNKNOWN = "unknown"


def _check_resume_kind(checkpoint: Path, wanted: int | None) -> None:
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
    if found != wanted:
        hint = (f"; stage 2 starts from stage-1 heads with --init-heads {checkpoint} and another --output-dir"
                if (found, wanted) == (1, 2) else "")
        raise ValueError(f"--resume: {checkpoint} was written by `{_run_kind(found)}`, not `{_run_kind(wanted)}`: "
                         f"resume it with that command, or choose another --output-dir{hint}")


def _kind_by_files(checkpoint: Path) -> int | None:
    """The Medusa stage whose files ``checkpoint`` holds (2: a full base, or a LoRA adapter of it, beside the heads);
    None: a causal LM's."""
    if not any((checkpoint / name).is_file() for name in (HEADS_NAME, LEGACY_HEADS_NAME)):
        return None
    if (checkpoint / ADAPTER_CONFIG_NAME).is_file():
        return 2
    config = checkpoint / CONFIG_NAME
    return 2 if config.is_file() and "model_type" in read_json(str(config)) else 1


def _wrong_files(found: int | None) -> str:
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


def base_name(model: str) -> str:
    # Written into the heads' config.json: an absolute path finds the base from anywhere; a Hub id stays one.
    return os.path.abspath(model) if Path(model).expanduser().exists() else model


def settings(config: FinetuneConfig, info: D.DistInfo, model_dir: Path, resume: Path | None, lr: float
             ) -> tuple[dict, list[run_settings.Change]]:
    """This run's settings (run_settings.py) and, resuming, how they differ from the checkpoint's (all allowed by
    --allow-changed-settings: a difference that is not raises)."""

    def decide():
        options = config.resume_settings(dtype=dtype_name(config, info.device), world_size=info.world_size, lr=lr)
        current = run_settings.collect(model=base_name(config.model), model_dir=model_dir, data=config.data,
                                       options=options)
        if resume is None:
            return current, []
        recorded = ckpt.load_trainer_state(resume, mmap=True).get("settings")
        if recorded is None:
            _say(f"note: {resume} records no run settings (written by an earlier version): this run's are not "
                 "checked against it")
            return current, []
        allowed = run_settings.parse_allowed(config.allow_changed_settings)
        return current, run_settings.check(recorded, current, allowed, resume)

    return _on_main(info, decide)


def data(config: FinetuneConfig, model_dir: Path, vocab_size: int,
         info: D.DistInfo) -> tuple[BatchStream, PackedDataset | None]:
    """The training stream and the packed eval data (None without --eval-data), tokenized alike."""
    tokenizer = load_tokenizer(model_dir)
    special = read_special_tokens(tokenizer, model_dir)
    note = chat_template_note(special, config.chat_template)  # refuses --chat-template model without a template
    if info.is_main and not config.quiet:
        print(note, flush=True)

    cache = config.data_cache_dir()

    def packed(paths) -> PackedDataset:
        def build() -> PackedDataset:
            return build_dataset(paths, tokenizer, special, config.seq_len, config.chat_template, cache_dir=cache)

        if cache is not None and info.distributed:
            # Rank 0 tokenizes and writes the cache; the others wait, then load what it wrote.
            dataset = build() if info.is_main else None
            D.barrier()
            dataset = dataset if info.is_main else build()
        else:
            dataset = build()
        _check_vocab(dataset, vocab_size)
        return dataset

    stream = BatchStream(packed(config.data), config.batch_size, seed=config.seed, rank=info.rank,
                         world_size=info.world_size)
    return stream, packed(config.eval_data) if config.eval_data else None


def finish(config: FinetuneConfig, info, model, task, data, groups, export, resume,
           settings_and_changes) -> RunResult:
    """Build the optimizer, schedule and Trainer, resume, train. ``settings_and_changes``: this run's settings, and
    how they differ from the resumed checkpoint's (allowed ones: :func:`settings`)."""
    stream, eval_data = data
    current, changes = settings_and_changes
    optimizer = build_optimizer(config.optimizer, groups, betas=(config.beta1, config.beta2), eps=config.adam_eps,
                                capturable=config.cuda_graph, kernel=config.adamw == "liger",
                                embeddings=trained_embeddings(model))
    warmup = config.warmup_steps if config.warmup_steps is not None else config.max_steps // 20
    scheduler = build_scheduler(optimizer, warmup, config.max_steps, config.min_lr_ratio)
    loop = TrainConfig(output_dir=config.output_dir, max_steps=config.max_steps, grad_accum=config.grad_accum,
                       max_grad_norm=config.max_grad_norm, log_every=config.log_every, save_every=config.save_every,
                       keep_last=config.keep_last, quiet=config.quiet,
                       optimizer_in_backward=config.optimizer_in_backward, cuda_graph=config.cuda_graph,
                       eval_every=config.eval_every, eval_batches=config.eval_batches or TrainConfig.eval_batches)
    # A LoRA checkpoint holds the adapters (and modules_to_save, heads): the frozen base is never gathered for it.
    trainer = Trainer(model, task, stream, optimizer, scheduler, loop, info, export, config.run_args(), eval_data,
                      settings=current, trained_only=config.lora_r is not None)
    if resume is not None:
        # Another --optimizer (let through by --allow-changed-settings) cannot take the saved state: its moments
        # start from zero, as at a run's first step; _go_on_with says so.
        trainer.resume(resume, optimizer_state=not any(c.name == "optimizer" for c in changes))
        if info.is_main and not config.quiet:
            print(f"resumed from {resume} at step {trainer.step}", flush=True)
    if changes:
        _go_on_with(changes, config, trainer, resume)
    start = time.perf_counter()
    with (loss_options(config.loss_scratch_mib, config.loss_grad_filter_eps),
          StopOnSignal(announce=info.is_main) as stop):
        trainer.stop_signal = lambda: stop.signum
        history = trainer.train()
    last = ckpt.find_latest(Path(config.output_dir) / "checkpoints")
    if info.is_main and not config.quiet and not trainer.stopped_by:
        print(f"done: {trainer.step} steps in {time.perf_counter() - start:.1f}s; checkpoint: {last}", flush=True)
    return RunResult(last, history, Path(config.output_dir), trainer.evals, trainer.stopped_by)


def _go_on_with(changes: list[run_settings.Change], config: FinetuneConfig, trainer: Trainer, resume: Path) -> None:
    """Continue with changed settings that --allow-changed-settings let through: said now, logged with the first
    resumed step. The model, optimizer and batches already take this run's options; the data order's seed is the
    one the checkpoint restored, unless --seed is among the changes."""
    if trainer.info.is_main:
        _say(f"resuming {resume} at step {trainer.step} with changed settings (--allow-changed-settings): "
             f"{run_settings.describe(changes)}")
    trainer.settings_changed = run_settings.logged(changes)
    if any(c.name == "optimizer" for c in changes) and trainer.info.is_main:
        _say(f"--optimizer {config.optimizer}: the optimizer's state starts from zero (the checkpoint's is another "
             "optimizer's)")
    if any(c.name == "seed" for c in changes):
        trainer.stream.load_state_dict({**trainer.stream.state_dict(), "seed": config.seed})


@contextlib.contextmanager
def loss_options(scratch_mib: int | None, grad_filter_eps: float | None = None):
    """--loss-scratch-mib and --loss-grad-filter-eps: linear-CE's max_scratch_bytes and grad_filter_eps settings for
    the run (every head's loss), then the defaults again."""
    changes = {}
    if scratch_mib is not None:
        changes["max_scratch_bytes"] = scratch_mib << 20
    if grad_filter_eps is not None:
        changes["grad_filter_eps"] = grad_filter_eps
    with tuned(flce, **changes):
        yield


def prepare(model: nn.Module, layers, config: FinetuneConfig, info, more_units=()) -> None:
    """Activation checkpointing and MLP chunks on ``layers``; under torchrun, FSDP2 units = ``layers`` +
    ``more_units``."""
    if config.activation_checkpointing:
        D.apply_activation_checkpointing(layers)
    if config.mlp_chunk_tokens is not None:
        chunk_mlps(layers, config.mlp_chunk_tokens)
    if info.distributed:
        D.apply_fsdp(model, [*layers, *more_units], info.device)


def in_process_group(run: Callable[[], RunResult], config: FinetuneConfig) -> RunResult:
    """Join the process group, hold ``--output-dir`` (run_dir.claimed: one run at a time, what killed writers left
    cleared), ``run()`` (which builds the model, FSDP units and optimizer, and trains), then leave the group.
    Everything run() built is freed before leaving, here on the main thread: FSDP modules hold the process group,
    and left alive (some in reference cycles) they would destroy its gloo connections later, from whatever thread
    next triggers a garbage collection, which aborts the process at exit ("terminate called without an active
    exception"; seen about one 2-process CPU run in six on a loaded machine). A run stopped by a signal raises
    :class:`Interrupted` only then, once every rank has left the group as after a finished run."""
    try:
        info = D.init_distributed(config.device)
        with run_dir.claimed(config.output_dir, info, config.data_cache_dir()), data_cache.digests_remembered():
            result = run()
    except BaseException:
        D.destroy_distributed(clean=False)  # a barrier could wait forever for a rank that died
        raise
    gc.collect()
    D.destroy_distributed(clean=True)
    if result.stopped_by:
        raise Interrupted(result.stopped_by, result.checkpoint)
    return result
