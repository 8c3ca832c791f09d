"""The loss call's labels: their range check and the loss's scale, queued on the device without stalling it.

Shared by cross_entropy.py and fused_linear_cross_entropy.py; the row kernel (_ce_core.py) reads LabelCheck's flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from .._launch import launch


@dataclass(frozen=True)
class LabelCheckTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # One program reads all labels, a block per round trip to memory: 8192 labels (a common batch) in one round over 16
    # warps. At 4096 over 4 warps the check took 6.1 µs of stream time for 8192 labels (H200,
    # benchmarks/tools/gpu_timeline.py).
    block: int = 8192
    num_warps: int = 16


TUNING = LabelCheckTuning()

# Pinned host buffers + events of finished checks, per device, for the next check to reuse: a fresh pinned
# tensor and event cost more host time than the check's own launch.
_SPARE: dict[int, list] = {}
# Every pinned buffer ever made stays referenced here. The check kernel writes into it directly, so a buffer whose check
# was dropped before wait() (an exception in between) must never return to torch's pinned-memory cache while that
# kernel may still be queued; it is simply never reused (16 bytes each).
_KEPT: list[torch.Tensor] = []


class LabelCheck:
    """The range check of a loss call's labels (outside [0, V) and not ignore_index is an error) and the call's
    scale (d loss / d per-token loss: loss_scale / denominator for reduction="mean", loss_scale for "sum"), without
    stalling the GPU and in one launch.

    The kernels index the logits with the label, so a bad label must never reach a load. On CUDA one kernel counts
    the bad labels into `flag` (count, index of the first) and writes `scale`; the loss kernels, queued after it,
    read `flag` and do nothing at all when it is set: no read out of bounds, and no logits overwritten by an
    in-place gradient. The same kernel also stores the flag straight into pinned host memory (mapped into the GPU's
    address space, as all pinned memory is under unified addressing), behind an event; `wait()` (at the end of the
    loss call, after its kernels are queued) blocks only until that event, then raises ValueError. A copy to the
    host queued on the stream instead held the loss kernel back by 5-14 µs (H200, 2026-11-30,
    benchmarks/tools/gpu_timeline.py). So the GPU always has the loss kernels queued while the host waits; a plain
    `.item()` before them left it idle for the whole host path from the sync to their launch (0.45 ms per call at
    8192×128256 on the H200, 2026-11-30), and the check and the scale took ~10 small launches. While a CUDA
    graph is being captured nothing is read on the host (the kernels still skip on a bad label); the capturer checks
    every batch it copies in (liger_models/train/cuda_graph.py). On CPU everything runs at once, in PyTorch.
    """

    def __init__(self, labels: torch.Tensor, vocab_size: int, ignore_index: int, reduction: str = "sum",
                 normalizer: float | torch.Tensor | None = None, loss_scale: float = 1.0):
        if labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"labels must be int64 (or int32), got {labels.dtype}")
        # The kernel reads labels with a unit stride; reshape(-1) keeps a strided 1-D view (a column, an expand).
        self.labels, self.vocab_size, self.ignore_index = labels.reshape(-1).contiguous(), vocab_size, ignore_index
        n, device = self.labels.numel(), labels.device
        self._event, self._counts = None, (0, 0)
        if not use_triton(labels):  # the PyTorch reference path
            bad = ((self.labels < 0) | (self.labels >= vocab_size)) & (self.labels != ignore_index)
            self.flag = torch.stack([bad.sum(), bad.int().argmax() if n else bad.sum()])
            self.scale = grad_scale(self.labels, ignore_index, reduction, normalizer, loss_scale)
            self._host = self.flag
            return
        self.flag = torch.empty(2, dtype=torch.int64, device=device)
        self.scale = torch.empty((), dtype=torch.float32, device=device)
        self._host = None
        if not labels.is_cuda:
            self._host = self.flag
        elif not torch.cuda.is_current_stream_capturing():  # while capturing, nothing is read on the host
            spare = _SPARE.setdefault(device.index, [])
            if spare:
                self._host, self._event = spare.pop()
            else:
                self._host, self._event = torch.empty(2, dtype=torch.int64, pin_memory=True), torch.cuda.Event()
                _KEPT.append(self._host)
        to_host = self._event is not None
        launch(_label_check_kernel, (1,),
               [self.labels if n else self.flag, self.flag, self.scale, self._host if to_host else self.flag, n,
                vocab_size, ignore_index, float(loss_scale)],
               dict(MEAN=reduction == "mean" and normalizer is None, TO_HOST=to_host, BLOCK=TUNING.block,
                    num_warps=TUNING.num_warps))
        if to_host:
            self._event.record()
        if reduction == "mean" and normalizer is not None:
            self.scale = grad_scale(self.labels, ignore_index, reduction, normalizer, loss_scale)

    def wait(self) -> None:
        """Raise ValueError if a label was bad (blocking until the check's result is on the host)."""
        if torch.compiler.is_compiling():
            # Nothing can be read while torch.compile traces. Only the PyTorch reference path gets here (the kernels
            # run their check inside their custom ops, at run time), and there the ops' own indexing fails on a bad
            # label.
            return
        if self._event is not None:
            self._event.synchronize()
        if self._host is not None:
            self._counts = self._host.tolist()
        if self._event is not None:  # the kernel is done and read: buffer and event are free for the next check
            _SPARE[self.labels.device.index].append((self._host, self._event))
            self._host = self._event = None
        n_bad, first_index = self._counts
        if n_bad:
            first = self.labels[first_index].item()
            raise ValueError(f"label {first} is outside the vocabulary [0, {self.vocab_size}) and is not "
                             f"ignore_index={self.ignore_index} ({n_bad} such labels)")


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise ValueError now for a label outside [0, V) that is not ignore_index (a host sync on CUDA)."""
    LabelCheck(labels, vocab_size, ignore_index).wait()


@triton.jit
def _label_check_kernel(LABELS, FLAG, SCALE, HOST_FLAG, n, vocab_size, ignore_index, loss_scale,
                        MEAN: tl.constexpr, TO_HOST: tl.constexpr, BLOCK: tl.constexpr):
    # One program: a batch has at most a few 100K labels, and one launch (no zeroed buffer, no atomics, no second
    # kernel for the scale) is what keeps the call's host part short. A while loop: Triton's interpreter cannot
    # run `for` to a runtime bound (numpy ≥ 2.4).
    n_bad = tl.zeros([BLOCK], tl.int32)
    n_valid = tl.zeros([BLOCK], tl.int32)
    first = tl.zeros([BLOCK], tl.int64) + n
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        label = tl.load(LABELS + offs, mask=offs < n, other=ignore_index).to(tl.int64)
        valid = label != ignore_index
        bad = ((label < 0) | (label >= vocab_size)) & valid
        n_bad += bad.to(tl.int32)
        n_valid += valid.to(tl.int32)
        first = tl.minimum(first, tl.where(bad, offs, n))
        start += BLOCK
    n_bad, first = tl.sum(n_bad, 0).to(tl.int64), tl.min(first, 0)
    tl.store(FLAG, n_bad)
    tl.store(FLAG + 1, first)
    if TO_HOST:  # pinned host memory: visible to the host once the event recorded after this kernel completes
        tl.store(HOST_FLAG, n_bad)
        tl.store(HOST_FLAG + 1, first)
    scale = loss_scale
    if MEAN:
        scale = loss_scale / tl.maximum(tl.sum(n_valid, 0), 1).to(tl.float32)  # all ignored: 0 / 1, loss 0
    tl.store(SCALE, scale)


def mean_denominator(valid: torch.Tensor, normalizer: float | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The divisor of reduction="mean" as a 0-dim device tensor; 0 counts as 1 so all-ignored gives loss 0."""
    if normalizer is None:
        denom = valid.sum().to(dtype)
    else:
        # 0-dim: a (1,)-shaped count would make the scale 1-D, which the row kernel reads as one scale per row
        denom = torch.as_tensor(normalizer, device=valid.device).reshape(()).to(dtype)
    return torch.where(denom == 0, torch.ones_like(denom), denom)


def grad_scale(labels: torch.Tensor, ignore_index: int, reduction: str, normalizer, loss_scale: float) -> torch.Tensor:
    """0-dim fp32 device tensor: d(loss)/d(per-token loss) for mean / sum (loss_scale / denominator, loss_scale)."""
    scale = torch.full((), loss_scale, dtype=torch.float32, device=labels.device)
    if reduction == "mean":
        scale = scale / mean_denominator(labels != ignore_index, normalizer, torch.float32)
    return scale
