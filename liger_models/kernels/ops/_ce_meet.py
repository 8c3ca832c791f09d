"""Programs of one row-kernel launch (_ce_core.py) that wait for each other: the programs of a split row meet
between their passes to merge partial statistics.

The meeting synchronises through int32 counters in device memory, handed out zeroed by `meeting_counters`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import pow2


@triton.jit
def _exp(v):
    # e^v as one MUFU.EX2 (flush-to-zero: a term below 1e-38 counts as 0). tl.exp lowers to the non-ftz ex2,
    # which ptxas wraps in a denormal range check: three more instructions per element in a loop that issues ~10.
    return tl.exp2(v * 1.4426950408889634)


@triton.jit
def _share_partials(PARTIAL, ARRIVED, part, m, s, sum_x, rank, x_t, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """A split row's programs meet: each publishes its pass-1 partials, then (PHASE 0) waits until all SPLIT have,
    then every one merges all of them. PHASE 1 only publishes, PHASE 2 only merges (the two launches of the
    interpreter, which runs programs one after another, so a program waiting for a later one would wait forever;
    x_t goes along, as the logit may be a gradient by the time a later program of PHASE 2 could read it).
    On the GPU the SPLIT programs of a row are consecutive in launch order, so each one's partners are resident
    or about to be: the wait cannot deadlock. PARTIAL: 8 fp32 slots per program."""
    PARTIAL_BITS = PARTIAL.to(tl.pointer_type(tl.int32))  # the same slots, as int32
    BITS = PARTIAL_BITS + 8 * part
    if PHASE != 2:
        # Scalar atomics (of the bits: the interpreter has no fp32 exchange) are issued by one thread, ordered
        # before the release below on that same thread.
        tl.atomic_xchg(BITS, m.to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_xchg(BITS + 1, s.to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_xchg(BITS + 2, sum_x.to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_xchg(BITS + 3, rank, sem="relaxed")
    if PHASE == 1:
        tl.store(PARTIAL + 8 * part + 4, x_t)
    if PHASE == 2:
        x_t = tl.load(PARTIAL + 8 * part + 4)
    if PHASE == 0:
        arrived = tl.atomic_add(ARRIVED, 1, sem="acq_rel", scope="gpu") + 1
        while arrived < SPLIT:
            arrived = tl.atomic_add(ARRIVED, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()  # every thread's loads below come after the acquire
    if PHASE != 1:
        parts = 8 * tl.arange(0, SPLIT)
        pm = tl.load(PARTIAL + parts, volatile=True)
        m = tl.max(pm, 0)
        s = tl.sum(tl.load(PARTIAL + parts + 1, volatile=True) * _exp(pm - m), 0)
        sum_x = tl.sum(tl.load(PARTIAL + parts + 2, volatile=True), 0)
        rank = tl.sum(tl.load(PARTIAL_BITS + parts + 3, volatile=True), 0)
    return m, s, sum_x, rank, x_t


# Meeting counters: per (device index, raw stream), a ring of int32 zeros and the offset of its unused part.
COUNTER_RING = 1 << 20
_COUNTERS: dict[tuple, list] = {}


def meeting_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros for one launch's meeting counters, from a ring zeroed once per lap rather than per launch.

    A torch.zeros per call cost 8 µs of stream time before the row kernel (H200, benchmarks/tools/gpu_timeline.py),
    and a kernel that zeroes its counters again on the way out stalls every program on the atomic's reply (+20 µs
    at 4096×256000, H200, 2026-11-30). Launches on one stream run one after another, so slices of the ring handed out
    in order never overlap in time (one Python thread launching on a stream at a time), and the lap's zero-fill is
    queued behind every launch that used it. A CUDA graph being captured gets zeros of its own (its memory stays
    with the graph)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    ring = _COUNTERS.get(key)
    if ring is None or ring[0].numel() < n:
        ring = _COUNTERS[key] = [torch.zeros(max(COUNTER_RING, pow2(n)), dtype=torch.int32, device=device), 0]
    elif ring[1] + n > ring[0].numel():
        ring[0].zero_()
        ring[1] = 0
    start = ring[1]
    ring[1] = start + n
    return ring[0][start : start + n]
