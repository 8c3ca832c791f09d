"""Programs of one row-kernel launch (_ce_core.py) that wait for each other: the programs of a split row meet
between their passes to merge partial statistics, and the last program of a launch sums the rows' losses.

Both synchronise through int32 counters in device memory that the kernel itself sets back to zero before it
exits (`meeting_counters` keeps one buffer per stream), so no launch needs a zero-fill of its own first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import pow2


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
        # Leaving: the last of the row's 2·SPLIT increments (every program is past its wait by then) sets the
        # counter back to 0, so the next launch finds it zeroed without a memset of its own (meeting_counters).
        if tl.atomic_add(ARRIVED, 1, sem="relaxed", scope="gpu") == 2 * SPLIT - 1:
            tl.atomic_xchg(ARRIVED, 0, sem="relaxed", scope="gpu")
    if PHASE != 1:
        parts = 8 * tl.arange(0, SPLIT)
        pm = tl.load(PARTIAL + parts, volatile=True)
        m = tl.max(pm, 0)
        s = tl.sum(tl.load(PARTIAL + parts + 1, volatile=True) * _exp(pm - m), 0)
        sum_x = tl.sum(tl.load(PARTIAL + parts + 2, volatile=True), 0)
        rank = tl.sum(tl.load(PARTIAL_BITS + parts + 3, volatile=True), 0)
    return m, s, sum_x, rank, x_t


@triton.jit
def _sum_losses(LOSS, SCALE, TOTAL, TICKET, n_rows, BLOCK: tl.constexpr):
    """TOTAL = scale · Σ LOSS, by whichever program finishes last (a ticket), in one fixed order: deterministic, and
    no reduce + multiply launches after the kernel (~8 µs of stream time per call on the H200)."""
    tl.debug_barrier()  # this program's stores (its row's loss) come before the release below
    if tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.debug_barrier()  # every thread's loads below come after the acquire
        acc = tl.zeros([BLOCK], tl.float32)
        start = tl.full((), 0, tl.int32)
        while start < n_rows:
            rows = start + tl.arange(0, BLOCK)
            acc += tl.load(LOSS + rows, mask=rows < n_rows, other=0.0, volatile=True)
            start += BLOCK
        tl.store(TOTAL, tl.sum(acc, 0) * tl.load(SCALE))
        tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # zero again for the next launch



# (device index, raw stream) → int32 zeros that the row kernel leaves zeroed (meeting counters, the REDUCE ticket).
_COUNTERS: dict[tuple, torch.Tensor] = {}


def meeting_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros for the row kernel's counters, which it sets back to zero before it exits.

    Kept per stream (launches on one stream run one after another, so they never share counters at once) instead of
    a torch.zeros per call: that fill cost 8 µs of stream time before the kernel (H200, benchmarks/gpu_timeline.py).
    A CUDA graph being captured gets its own buffer (its memory stays with the graph; a cached one could be
    replaced by a larger one while the graph still points at it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(pow2(n), dtype=torch.int32, device=device)
    return buf
