"""The training loop shared by causal-LM fine-tuning and Medusa stage 1 / stage 2.

One optimizer step = ``grad_accum`` micro-batches per rank. Before any forward, the step's micro-batches are drawn
and their non-ignored targets counted per loss term (one count for a causal LM; base + each Medusa head for Medusa,
whose shifted targets differ), summed over micro-batches and all-reduced over ranks. That global count is passed as
every micro-batch's ``normalizer``, so the summed micro-batch losses, and their gradients, equal the mean over the
whole global batch, however it is split (FSDP sums ranks' gradients, see distributed.py). A mixture-of-experts
load-balancing loss, which is no such mean, is computed over each global micro-batch by the ranks together.

Each step logs loss, per-head top-1/top-5 accuracy, tokens/s, peak memory, LR and gradient norm to stderr and to
``<output_dir>/metrics.jsonl``; every ``save_every`` steps (and at the end) an atomic checkpoint is written.
:meth:`Trainer.resume` restores step, optimizer, scheduler, data position and RNG, so the run continues exactly as
if it had not stopped.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from liger_models.medusa import medusa_target_counts
from liger_models.modules import shift_labels, static_document_mask
from liger_models.modules.inputs import token_ids_checked_already
from liger_models.train import checkpointing as ckpt
from liger_models.train import distributed as D
from liger_models.train import evaluate as ev
from liger_models.train.cuda_graph import GraphedStep
from liger_models.train.disk_space import reported as disk_full_reported
from liger_models.train.batches import BatchStream
from liger_models.train.packing import IGNORE_INDEX, PackedDataset, batch_to
from liger_models.train.step_in_backward import OptimizerInBackward

GRAPH_WARMUP = 3  # eager steps before the capture: Triton compiles, cuBLAS/cuDNN settle, AdamW builds its state


@dataclass
class TrainConfig:
    """Loop settings (the optimizer and scheduler are built by the caller)."""

    output_dir: str
    max_steps: int
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    log_every: int = 1
    save_every: int = 0  # 0: save only at the end
    keep_last: int = 2
    quiet: bool = False
    optimizer_in_backward: bool = False  # update each parameter inside backward (step_in_backward.py)
    cuda_graph: bool = False  # replay each step from a CUDA graph after GRAPH_WARMUP eager steps (cuda_graph.py)
    eval_every: int = 0  # with eval data: evaluate every N steps (0: only at the end), evaluate.py
    eval_batches: int = 20  # eval rounds (one micro-batch per rank each) per evaluation


def _untied_lm_head(causal_lm: nn.Module) -> list[torch.Tensor]:
    """[lm_head.weight] unless it is the input embedding's (tied: it also gets the embedding's gradient)."""
    w = causal_lm.lm_head.weight
    return [] if w is causal_lm.model.embed_tokens.weight else [w]


class CausalLMTask:
    """Next-token loss of a ``Liger<Family>ForCausalLM``: one loss term."""

    num_terms = 1
    head_names: tuple[str, ...] = ()

    @staticmethod
    def loss_weights_used_once(model: nn.Module) -> list[torch.Tensor]:
        """Trainable weights whose whole gradient comes from one linear-CE call: an untied lm_head."""
        return [w for w in _untied_lm_head(model) if w.requires_grad]

    def counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        targets = shift_labels(batch["labels"], 1, batch["position_ids"], IGNORE_INDEX)
        return (targets != IGNORE_INDEX).sum().view(1)

    def forward(self, model: nn.Module, batch: dict, normalizer: torch.Tensor, step: int, max_steps: int):
        with token_ids_checked_already():  # the dataset's ids were checked against the vocabulary when it was built
            out = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                        normalizer=normalizer[0])
        return out.loss, out.loss.detach().view(1)


class MedusaTask:
    """``MedusaModel`` loss: per-term normalizers (base + K heads) and per-head losses and accuracy counts.

    Stats layout (all summed over micro-batches and ranks): [loss, base_loss, head_loss × K, top1 × K, top5 × K,
    count × K].
    """

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.num_terms = num_heads + 1
        self.head_names = tuple(f"head{k}" for k in range(1, num_heads + 1))

    @staticmethod
    def loss_weights_used_once(model: nn.Module) -> list[torch.Tensor]:
        """Trainable weights whose whole gradient comes from one linear-CE call: each head's own lm_head copy, and in
        stage 2 an untied base lm_head the heads do not share."""
        heads = model.heads
        used = [] if heads.config.share_lm_head else [*map(heads.weight, range(heads.num_heads)),
                                                      *_untied_lm_head(model.base)]
        return [w for w in used if w.requires_grad]

    def counts(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:

        return medusa_target_counts(batch["labels"], self.num_heads, batch["position_ids"], IGNORE_INDEX)

    def forward(self, model: nn.Module, batch: dict, normalizer: torch.Tensor, step: int, max_steps: int):
        with token_ids_checked_already():  # the dataset's ids were checked against the vocabulary when it was built
            out = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"], step=step,
                        max_steps=max_steps, normalizer=normalizer)
        base = out.base_loss.detach().float().view(1) if out.base_loss is not None else out.loss.new_zeros(1)
        stats = torch.cat([out.loss.detach().float().view(1), base.to(out.loss.device),
                           out.head_losses.float(), out.head_top1.float(), out.head_top5.float(),
                           out.head_count.float()])
        return out.loss, stats


def json_line(record: dict) -> str:
    """One line of a metrics file in strict JSON: a non-finite number (a diverged loss, an accuracy over no tokens)
    becomes null. Python's default writes NaN / Infinity, which jq, JavaScript and other strict readers refuse."""

    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [strict(v) for v in value]
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        return value

    return json.dumps(strict(record), allow_nan=False) + "\n"


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB → GiB (peak RSS)


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients to ``max_norm`` (0: only measure); the total norm as a device tensor (no host read, so a
    CUDA graph can hold it; DTensor under FSDP)."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))


def _refuse(option: str, *conflicts: tuple[bool, str]) -> None:
    """Raise ValueError naming every conflict that holds: "<option>, so it cannot be combined with <a>, <b>"."""
    problems = [why for holds, why in conflicts if holds]
    if problems:
        raise ValueError(f"{option}, so it cannot be combined with " + ", ".join(problems))


def refuse_in_backward_conflicts(grad_accum: int, max_grad_norm: float, distributed: bool) -> None:
    """What --optimizer-in-backward cannot go with (the Trainer checks it; run.py before loading anything)."""
    _refuse("--optimizer-in-backward frees each gradient as soon as it is used",
            (grad_accum > 1, "gradient accumulation (--grad-accum > 1)"),
            (max_grad_norm > 0, "clipping (--max-grad-norm > 0)"),
            (distributed, "FSDP (several processes)"))


def refuse_cuda_graph_conflicts(cpu: bool, distributed: bool, in_backward: bool,
                                activation_checkpointing: bool = False, schedule: str = "constant", *,
                                mlp_chunks: bool = False) -> None:
    """What --cuda-graph cannot go with (the Trainer checks it; run.py before loading anything)."""
    _refuse("--cuda-graph replays one process's whole step on one GPU",
            (cpu, "a CPU device"),
            (distributed, "FSDP (several processes)"),
            (in_backward, "--optimizer-in-backward"),
            (activation_checkpointing, "--activation-checkpointing (its recomputation saves and restores the RNG "
                                       "state on the host inside the step)"),
            (mlp_chunks, "--mlp-chunk-tokens (each chunk is a checkpoint, recomputed the same way)"),
            (schedule != "constant", f"the heads' loss-weight schedule {schedule!r} (it changes every step, and a "
                                     "graph replays the weights it captured: use --schedule constant)"))


def _log_record(line: str) -> dict | None:
    """A metrics / eval log line as a dict, or None for a blank or torn one: a job killed (or out of disk) while
    appending leaves a partial last line, which must not make the run impossible to resume."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def _to_float(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class Trainer:
    """Runs the optimisation; ``export(dir, full_state, final_dir)`` writes the model files of a checkpoint (rank 0)
    into dir, which is renamed final_dir once the checkpoint is complete.

    ``full_state`` is the gathered state dict under FSDP and None otherwise (the live model is whole then); with
    ``trained_only`` (a checkpoint holds the LoRA adapters, not the frozen base they train on) it holds only the
    parameters that train, by parameter name (D.full_trained_state).
    ``settings``: what defines the run (run_settings.py), saved with every checkpoint; :attr:`settings_changed`, set
    by a resume that changed some, is logged with the next step's metrics.
    A full disk while writing a checkpoint or a log raises disk_space.DiskFull, which says where and that the last
    checkpoint is intact.
    ``stop_signal()``: the number of a signal asking the run to stop (0: none; interrupt.py). Checked after every
    step, as its maximum over the ranks (the signal may reach them at different steps), so that every rank stops,
    checkpointed, after the same step; :attr:`stopped_by` then holds it.
    """

    stop_signal: Callable[[], int] = staticmethod(lambda: 0)
    stopped_by = 0
    settings_changed: dict | None = None

    def __init__(self, model: nn.Module, task, stream: BatchStream, optimizer: torch.optim.Optimizer,
                 scheduler, config: TrainConfig, info: D.DistInfo,
                 export: Callable[[Path, dict | None, Path], None], run_args: dict | None = None,
                 eval_data: PackedDataset | None = None, settings: dict | None = None, trained_only: bool = False):
        self.model, self.task, self.stream = model, task, stream
        self.optimizer, self.scheduler, self.config, self.info = optimizer, scheduler, config, info
        self.export, self.run_args, self.settings = export, run_args or {}, settings
        self.trained_only = trained_only
        self.step = 0
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.in_backward = None
        if config.optimizer_in_backward:
            refuse_in_backward_conflicts(config.grad_accum, config.max_grad_norm, info.distributed)
            used_once = getattr(task, "loss_weights_used_once", lambda _: [])(model)
            self.in_backward = OptimizerInBackward(optimizer, in_forward=used_once)
        self.graphed = None
        if config.cuda_graph:
            # A Medusa model's heads schedule (a causal LM's config has none): the step number is baked into the graph.
            schedule = getattr(model.config, "scheduler", "constant")
            refuse_cuda_graph_conflicts(info.device.type != "cuda", info.distributed, config.optimizer_in_backward,
                                        schedule=schedule)
            vocab = model.config.vocab_size
            self.graphed = GraphedStep(self._graph_body, optimizer, warmup=GRAPH_WARMUP,
                                       label_keys={f"{j}.labels": (vocab, IGNORE_INDEX)
                                                   for j in range(config.grad_accum)})
        self.output_dir = Path(config.output_dir)
        self.checkpoints = self.output_dir / "checkpoints"
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.eval_path = self.output_dir / "eval.jsonl"
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.eval_set = None  # the same batches every evaluation: moved to the device once
        if eval_data is not None:
            self.eval_set = [batch_to(b, info.device)
                             for b in ev.eval_batches(eval_data, stream.batch_size, info, config.eval_batches)]

    # --------------------------------------------------------------------------------------------- one step

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches; returns the step's (global) metrics."""
        cfg = self.config
        micro = [batch_to(self.stream.next_batch(), self.info.device) for _ in range(cfg.grad_accum)]
        counts, normalizer = ev.global_counts(self.task, micro)
        self.model.train()
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]  # a tensor once a CUDA graph holds it
        if self.graphed is not None:
            inputs = {f"{j}.{k}": v for j, batch in enumerate(micro) for k, v in batch.items()}
            stats, norm = self.graphed({**inputs, "normalizer": normalizer})
            stats, grad_norm = stats.clone(), _to_float(norm)  # the graph's outputs are overwritten next replay
        elif self.in_backward is not None:  # backward updates every parameter and frees its gradient
            stats = self._accumulate(micro, normalizer)
            grad_norm = None  # no moment holds every gradient
        else:
            stats, norm = self._accumulate_and_step(micro, normalizer)
            grad_norm = _to_float(norm)
        self.scheduler.step()
        D.all_reduce_sum(stats)
        self.step += 1
        return self._metrics(stats.tolist(), counts.tolist(), grad_norm, lrs)

    def _accumulate(self, micro: list[dict], normalizer: torch.Tensor) -> torch.Tensor:
        """Forward + backward over the micro-batches, gradients summed; returns the summed stats."""
        stats = None
        with D.balanced_over_ranks():
            for batch in micro:
                loss, s = self.task.forward(self.model, batch, normalizer, self.step, self.config.max_steps)
                # FSDP averages gradients over ranks; each loss is a share of the global mean, so they must add up.
                (loss * self.info.world_size if self.info.distributed else loss).backward()
                stats = s if stats is None else stats + s
        return stats

    def _accumulate_and_step(self, micro: list[dict], normalizer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step with no host read, so a CUDA graph can capture it: (stats, gradient norm) as device
        tensors."""
        stats = self._accumulate(micro, normalizer)
        norm = _clip(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, norm

    def _graph_body(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: GraphedStep's flat static inputs {"<j>.<key>": tensor, "normalizer": tensor}."""
        micro = [{k.split(".", 1)[1]: v for k, v in inputs.items() if k.startswith(f"{j}.")}
                 for j in range(self.config.grad_accum)]
        with static_document_mask():  # one attention path for warm-up, capture and every replay
            return self._accumulate_and_step(micro, inputs["normalizer"])

    def _metrics(self, stats: list[float], counts: list[float], grad_norm: float, lrs: list[float]) -> dict:
        return {**self._loss_fields(stats, counts), "lr": lrs[-1], "lrs": lrs, "grad_norm": grad_norm,
                "epoch": round(self.stream.epoch, 4)}

    def _loss_fields(self, stats: list[float], counts: list[float]) -> dict:
        """step, loss, targets and (Medusa) base / per-head loss and top-1 / top-5 accuracy from summed stats."""
        m = {"step": self.step, "loss": stats[0], "targets": int(counts[0])}
        K = len(self.task.head_names)
        if K:
            base, losses = stats[1], stats[2:2 + K]
            top1, top5, cnt = stats[2 + K:2 + 2 * K], stats[2 + 2 * K:2 + 3 * K], stats[2 + 3 * K:2 + 4 * K]
            m["base_loss"] = base if base else None
            m["head_loss"] = losses
            m["head_top1"] = [t / max(c, 1) for t, c in zip(top1, cnt)]
            m["head_top5"] = [t / max(c, 1) for t, c in zip(top5, cnt)]
        return m

    # --------------------------------------------------------------------------------------------- loop

    def train(self) -> list[dict]:
        """Train until ``max_steps``; returns this session's per-step metrics."""
        cfg = self.config
        if self.info.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if self.step == 0:  # a fresh run starts fresh logs (a resumed one's were trimmed in resume())
                with self._writing("the metrics log", self.metrics_path):
                    self.metrics_path.write_text("", encoding="utf-8")
                if self.eval_set is not None:
                    with self._writing("the eval log", self.eval_path):
                        self.eval_path.write_text("", encoding="utf-8")
                elif self.eval_path.is_file():  # a rerun without --eval-data leaves no stale eval log behind
                    self.eval_path.unlink()
        tokens_per_step = self.stream.batch_size * self.stream.dataset.seq_len * cfg.grad_accum * self.info.world_size
        start = time.perf_counter()
        start_step = self.step
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            m = self.train_step()
            dt = time.perf_counter() - t0
            m["tokens_per_s"] = tokens_per_step / max(dt, 1e-9)
            m["mem_gib"] = _memory_gib(self.info.device)
            m["elapsed_s"] = time.perf_counter() - start
            if self.settings_changed:  # the first step run with them
                m["settings_changed"], self.settings_changed = self.settings_changed, None
            self.history.append(m)
            if self.info.is_main:
                self._log(m, start_step)  # a diverged step too: its line is what a user looks for
            if not math.isfinite(m["loss"]):
                raise FloatingPointError(f"loss is {m['loss']} at step {self.step}; stopping (lower --lr?)")
            if self.eval_set is not None and ((cfg.eval_every and self.step % cfg.eval_every == 0)
                                              or self.step == cfg.max_steps):
                self.evaluate()
            saved = None
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.max_steps:
                saved = self.save()
            if self.step < cfg.max_steps and (signum := D.max_over_ranks(self.stop_signal(), self.info.device)):
                self._stop(signum, saved or self.save())
                break
        if self.info.is_main and not cfg.quiet and sys.stderr.isatty():
            print(file=sys.stderr)
        return self.history

    def evaluate(self) -> dict:
        """Loss (and head accuracy) on the eval set now; appended to ``eval.jsonl`` and ``self.evals``."""
        stats, counts = ev.evaluate(self.model, self.task, self.eval_set, self.info, self.step, self.config.max_steps)
        m = self._loss_fields(stats, counts)
        self.evals.append(m)
        if self.info.is_main:
            with self._writing("the eval log", self.eval_path), self.eval_path.open("a", encoding="utf-8") as f:
                f.write(json_line(m))
            if not self.config.quiet:
                end = "\n" if sys.stderr.isatty() else ""  # below the progress line, which ends without one
                print(end + " | ".join([f"eval at step {self.step}", *self._loss_parts(m)]), file=sys.stderr,
                      flush=True)
        return m

    @staticmethod
    def _loss_parts(m: dict) -> list[str]:
        parts = [f"loss {m['loss']:.4f}"]
        if "head_top1" in m:
            accs = " ".join(f"{a * 100:.0f}/{b * 100:.0f}" for a, b in zip(m["head_top1"], m["head_top5"]))
            parts.append(f"heads top1/top5% {accs}")
        return parts

    def _log(self, m: dict, start_step: int) -> None:
        with self._writing("the metrics log", self.metrics_path), self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json_line(m))
        cfg = self.config
        if cfg.quiet or not (self.step % cfg.log_every == 0 or self.step == cfg.max_steps or self.step == 1):
            return
        done = self.step - start_step
        eta = m["elapsed_s"] / max(done, 1) * (cfg.max_steps - self.step)
        parts = [f"step {self.step}/{cfg.max_steps}", *self._loss_parts(m)]
        parts += [f"{m['tokens_per_s'] / 1e3:.1f}k tok/s", f"mem {m['mem_gib']:.2f} GiB", f"lr {m['lr']:.2e}",
                  f"eta {eta:.0f}s"]
        line = " | ".join(parts)
        if sys.stderr.isatty():
            print("\r" + line.ljust(120), end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def _stop(self, signum: int, checkpoint: Path) -> None:
        self.stopped_by = signum
        if self.info.is_main:  # said even with --quiet: it is where the run is to be continued from
            end = "\n" if sys.stderr.isatty() else ""  # below the progress line, which ends without one
            print(f"{end}liger-models: stopped by {signal.Signals(signum).name} after step {self.step}/"
                  f"{self.config.max_steps}; checkpoint: {checkpoint} (continue with --resume auto)",
                  file=sys.stderr, flush=True)

    # --------------------------------------------------------------------------------------------- checkpoints

    def _writing(self, what: str, path: Path):
        """A block that writes ``path``: a full disk in it raises disk_space.DiskFull (the class docstring)."""
        return disk_full_reported(what, path, lambda: ckpt.find_latest(self.checkpoints))

    def save(self) -> Path | None:
        """Write an atomic checkpoint of the current step (collective: every rank must call it)."""
        full_state = None
        if self.info.distributed:
            full_state = (D.full_trained_state if self.trained_only else D.full_model_state)(self.model)
        optim_state = D.full_optimizer_state(self.model, self.optimizer)
        rngs = D.gather_objects(ckpt.rng_state())
        path = None
        if self.info.is_main:
            state = {
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "data": self.stream.state_dict(),
                "rng": rngs,
                "world_size": self.info.world_size,
                "config": asdict(self.config),
                "args": self.run_args,
            }
            if self.settings is not None:
                state["settings"] = self.settings
            with self._writing("checkpoint", self.checkpoints / ckpt.step_dir_name(self.step)):
                path = ckpt.save_checkpoint(self.checkpoints, self.step,
                                            lambda tmp, final: self.export(tmp, full_state, final), state,
                                            self.config.keep_last)
        D.barrier()
        return D.broadcast_object(path)

    def resume(self, ckpt_dir: str | Path, *, optimizer_state: bool = True) -> None:
        """Restore optimizer, scheduler, data position, RNG and step from ``ckpt_dir`` (the model's weights were
        already loaded from its files by the caller). Every rank calls this. ``optimizer_state=False``: keep this
        optimizer's fresh state (a resume into another kind of optimizer), the rest is restored all the same."""
        state = ckpt.load_trainer_state(ckpt_dir)
        if int(state["step"]) > self.config.max_steps:
            raise ValueError(f"--max-steps {self.config.max_steps} is below the step of the checkpoint resumed "
                             f"({ckpt_dir}: step {state['step']}); give at least that many to continue")
        # This run's settings (--lr, --weight-decay, betas): the saved optimizer groups and scheduler base_lrs carry
        # the checkpoint's, which would silently replace them (the schedule's shape is this run's already).
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        base_lrs = list(self.scheduler.base_lrs)
        if optimizer_state:
            D.load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.scheduler.base_lrs = base_lrs
        # The lr of the first resumed step is this run's schedule at the restored step: the very value the checkpoint
        # saved when the schedule is unchanged, and the longer schedule's when a finished run is extended
        # (--max-steps raised), instead of the saved value from the old schedule's end.
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       getattr(self.scheduler, "lr_lambdas", ())):
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self.stream.load_state_dict(state["data"])
        rngs = state["rng"]
        ckpt.set_rng_state(rngs[self.info.rank] if len(rngs) == self.info.world_size else rngs[0])
        self.step = int(state["step"])
        for path in (self.metrics_path, self.eval_path):
            if self.info.is_main and path.is_file():
                # Drop what was logged after the checkpoint: it is about to be recomputed.
                lines = path.read_text(encoding="utf-8").splitlines()
                kept = [ln for ln in lines if (record := _log_record(ln)) is not None and record["step"] <= self.step]
                with self._writing("the log", path):
                    ckpt.write_text_atomic(path, "".join(ln + "\n" for ln in kept))
