"""A Hopper GEMM written in Gluon (Triton's low-level dialect) with the SwiGLU product in its epilogue (issue 6).

`gemm_epilogue_probe.py` found that Triton's `tl.dot` kernels do not hide a gated epilogue: fused minus plain costs
about what the separate gated kernel does. Gluon exposes what a kernel needs to hide it: wgmma issued
asynchronously, TMA loads into a shared-memory ring guarded by mbarriers, and asynchronous TMA stores that are
waited on only when their buffer is reused. This kernel is persistent and pipelined across its tiles:
- the loads run NUM_BUF − 1 K-steps ahead of the MMAs over one flat sequence of (tile, K-step), so the next tile's
  first loads are in flight while this tile's epilogue runs;
- each tile computes a gate block and its up block (two accumulators over one x tile, two wgmmas per K-step);
- the epilogue writes gate and up (kept for the backward) and act = silu(gate)·up through two staging buffers and
  TMA stores that drain during the next tile's mainloop.

`--compile-only` compiles for sm_90 on a machine without a GPU (Triton ships ptxas; use the GPU's Triton version,
3.6, since Gluon's API moves between releases) and prints registers, spills and shared memory. Otherwise the kernel
is checked against cuBLAS + this project's gated kernel and timed beside them at the e2e MLP shapes, fused and
plain (the same mainloop without the act).

Measured on the H200 (BENCHMARKS.md, twenty-fifth session), correct to the bit:
- The software-pipelined kernel (`--modes pipelined`) runs its mainloop at 470-590 TFLOP/s against cuBLAS's
  650-790, so it loses before any epilogue.
- The warp-specialised one (`--modes ws`: a producer warp for the loads, the kernel's warps for wgmma and the
  epilogue) reaches 610-680 TFLOP/s. Fused, it beat cuBLAS + the gated kernel by 1.4-3.2% at 4 of 5 shapes, in one
  run, and lost by 10% at Llama-1B's.

    python benchmarks/gluon_gated_gemm_probe.py --out DIR [--shapes llama-3.2-1b,gemma-2b] [--compile-only]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemm_epilogue_probe import mlp_inputs, rel_err, write_rows

SHAPES = {  # name → (tokens, hidden, intermediate), as gemm_epilogue_probe.py
    "llama-3.2-1b": (16384, 2048, 8192),
    "qwen2.5-1.5b": (16384, 1536, 8960),
    "gemma-2b": (16384, 2048, 16384),
    "llama-3-8b-w8l": (8192, 4096, 14336),
    "phi-3-mini-w8l": (16384, 3072, 8192),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUF, num_warps[, subtiled epilogue]); BLOCK_N is each half's width: a 128 × 256
# wgmma for 128. Two-accumulator version (calls 1-2): (128, 128, 64, 3, 8) led; 2 buffers, BLOCK_K 32 with 5-6
# buffers, or 4 warps on 128×64 / 64×128 tiles were 25–45% slower. Call 4 (warp-specialised): (128, 128, 64, 3, 8)
# led at every shape. A subtiled epilogue (staging 2 × 128 × 64) frees the shared memory for a fourth ring slot.
CONFIGS = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8, True), (128, 128, 64, 3, 8, True), (128, 64, 64, 5, 4)]
GROUP_M = 8
WS_LOADER_REGS = gl.constexpr(40)  # the producer warp's registers (tile coordinates and TMA issue only)
WS_MAXNREG = 168  # 8 consumer warps + a producer warpgroup within the register file: 168 × 12 × 32 ≤ 65536


@gluon.constexpr_function
def _acc_layout(block_m, block_n, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each) as far as BLOCK_M allows, the widest
    instruction N that divides BLOCK_N."""
    warps_m = min(num_warps, block_m // 16)
    warps_n = num_warps // warps_m
    n = block_n // warps_n
    while n > 256 or block_n % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, n, 16])


@gluon.jit
def _tile_of(step, k_steps, first_tile, n_programs, n_m, n_n, GROUP: gl.constexpr):
    """Output tile (pid_m, pid_n) of this program's flat K-step `step`; grouped so GROUP row tiles share a
    weight block while it is in L2."""
    tile = first_tile + (step // k_steps) * n_programs
    per_group = GROUP * n_n
    first_m = (tile // per_group) * GROUP
    rows = gl.minimum(n_m - first_m, GROUP)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@gluon.jit
def _schedule(M, HALF, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """This program's share of the persistent grid: tiles along M and N, K-steps per tile, its first tile, the
    grid's size, and the number of tiles it owns."""
    n_m = gl.cdiv(M, BLOCK_M)
    n_n = gl.cdiv(HALF, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    first_tile = gl.program_id(0)
    n_programs = gl.num_programs(0)
    return n_m, n_n, k_steps, first_tile, n_programs, gl.cdiv(n_m * n_n - first_tile, n_programs)


@gluon.jit
def _load_step(step, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, bar, x_buf, w_buf,
               GROUP: gl.constexpr, pred):
    """TMA-load K-step `step`'s x tile and its [gate block; up block] weight tile into one ring slot, counted on
    `bar` (nothing where pred is false)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_2N: gl.constexpr = w_desc.block_type.shape[0]
    pid_m, pid_n = _tile_of(step, k_steps, first_tile, n_programs, n_m, n_n, GROUP)
    k = (step % k_steps) * BLOCK_K
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [pid_m * BLOCK_M, k], bar, x_buf, pred)
    tma.async_copy_global_to_shared(w_desc, [pid_n * BLOCK_2N, k], bar, w_buf, pred)


@gluon.jit
def _issue_load(step, total, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, bars, x_bufs, w_bufs,
                NUM_BUF: gl.constexpr, GROUP: gl.constexpr):
    """_load_step into ring slot step % NUM_BUF, nothing past `total` (the software-pipelined kernel)."""
    slot = step % NUM_BUF
    _load_step(step, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, bars.index(slot),
               x_bufs.index(slot), w_bufs.index(slot), GROUP, step < total)


@gluon.jit
def _stage_store(staging, index: gl.constexpr, value, desc, row, col):
    """One TMA store through staging buffer `index` of two used in turn: the store issued before the previous one
    has left this buffer once at most one is pending."""
    tma.store_wait(pendings=1)
    staging.index(index).store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, col], staging.index(index))


@gluon.jit
def _silu_times(gate, up):
    g = gate.to(gl.float32)  # from the stored bf16 values, as the backward will recompute it
    return (g / (1.0 + gl.exp(-g)) * up.to(gl.float32)).to(gate.dtype)


@gluon.jit
def _store_tile(acc, staging, out_desc, act_desc, off_m, off_n, HALF, FUSED: gl.constexpr):
    """Epilogue: the accumulator's column halves (each thread's own registers, no data moves between threads) go
    out as gate and up; FUSED, act = silu(gate)·up follows. The staging buffers are as wide as a half, or half of
    that (subtiled: 32 KiB less shared memory, room for a fourth ring slot). The stores drain during the next
    tile's mainloop."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1] // 2
    CHUNK: gl.constexpr = out_desc.block_type.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    gate, up = gl.split(gl.permute(gl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    gate = gate.to(dtype)
    up = up.to(dtype)
    if CHUNK == BLOCK_N:
        tma.store_wait(pendings=0)  # the previous tile's stores have left both staging buffers
        staging.index(0).store(gate)
        staging.index(1).store(up)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], staging.index(0))
        tma.async_copy_shared_to_global(out_desc, [off_m, HALF + off_n], staging.index(1))
        if FUSED:
            act = _silu_times(gate, up)
            tma.store_wait(pendings=1)  # gate's store is out of staging buffer 0
            staging.index(0).store(act)
            fence_async_shared()
            tma.async_copy_shared_to_global(act_desc, [off_m, off_n], staging.index(0))
    else:
        gl.static_assert(CHUNK * 2 == BLOCK_N, "staging buffers hold a half or a quarter of the tile's columns")
        gate0, gate1 = gl.split(gl.permute(gl.reshape(gate, (BLOCK_M, 2, CHUNK)), (0, 2, 1)))
        up0, up1 = gl.split(gl.permute(gl.reshape(up, (BLOCK_M, 2, CHUNK)), (0, 2, 1)))
        _stage_store(staging, 0, gate0, out_desc, off_m, off_n)
        _stage_store(staging, 1, gate1, out_desc, off_m, off_n + CHUNK)
        _stage_store(staging, 0, up0, out_desc, off_m, HALF + off_n)
        _stage_store(staging, 1, up1, out_desc, off_m, HALF + off_n + CHUNK)
        if FUSED:
            _stage_store(staging, 0, _silu_times(gate0, up0), act_desc, off_m, off_n)
            _stage_store(staging, 1, _silu_times(gate1, up1), act_desc, off_m, off_n + CHUNK)


@gluon.jit
def _gated_gemm_kernel(x_desc, w_desc, out_desc, act_desc, M, HALF, K, NUM_BUF: gl.constexpr, GROUP: gl.constexpr,
                       FUSED: gl.constexpr, num_warps: gl.constexpr):
    """gate_up = x · [W_gate; W_up]ᵀ (HALF columns each) and, FUSED, act = silu(gate)·up; persistent over tiles.
    w is the interleaved weight (interleave()): one [gate block; up block] tile feeds one wgmma of the full tile
    width, and the accumulator's two column halves are gate and up. Without FUSED it is the plain GEMM (the same
    mainloop), to tell the mainloop's cost from the epilogue's."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_2N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = BLOCK_2N // 2
    dtype: gl.constexpr = x_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_2N, num_warps)

    x_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_2N, BLOCK_K], w_desc.layout)
    staging = gl.allocate_shared_memory(dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(bars.index(i), count=1)

    n_m, n_n, k_steps, first_tile, n_programs, tiles = _schedule(M, HALF, K, BLOCK_M, BLOCK_N, BLOCK_K)
    total = tiles * k_steps

    for s in gl.static_range(NUM_BUF - 1):
        _issue_load(s, total, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, bars, x_bufs, w_bufs,
                    NUM_BUF, GROUP)
    acc = gl.zeros((BLOCK_M, BLOCK_2N), dtype=gl.float32, layout=acc_layout)
    for step in range(total):
        slot = step % NUM_BUF
        mbarrier.wait(bars.index(slot), (step // NUM_BUF) & 1)
        acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                            use_acc=(step % k_steps) != 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step's wgmma is done: its slot is free
        _issue_load(step + NUM_BUF - 1, total, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, bars,
                    x_bufs, w_bufs, NUM_BUF, GROUP)
        if (step % k_steps) == k_steps - 1:
            acc = warpgroup_mma_wait(0, deps=(acc,))
            pid_m, pid_n = _tile_of(step, k_steps, first_tile, n_programs, n_m, n_n, GROUP)
            _store_tile(acc, staging, out_desc, act_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, HALF, FUSED)
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _ws_loader(x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, HALF, K, GROUP: gl.constexpr):
    """Warp-specialised producer (one warp): the same flat (tile, K-step) sequence as the consumer, each load
    issued as soon as its ring slot is released, up to NUM_BUF steps ahead."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_2N: gl.constexpr = w_desc.block_type.shape[0]
    NUM_BUF: gl.constexpr = x_bufs.type.shape[0]
    n_m, n_n, k_steps, first_tile, n_programs, tiles = _schedule(M, HALF, K, BLOCK_M, BLOCK_2N // 2, BLOCK_K)
    for step in range(tiles * k_steps):
        slot = step % NUM_BUF
        mbarrier.wait(empty.index(slot), ((step // NUM_BUF) & 1) ^ 1)  # a fresh barrier counts as released
        _load_step(step, k_steps, first_tile, n_programs, n_m, n_n, x_desc, w_desc, ready.index(slot),
                   x_bufs.index(slot), w_bufs.index(slot), GROUP, True)


@gluon.jit
def _ws_consumer(x_desc, w_desc, out_desc, act_desc, x_bufs, w_bufs, staging, ready, empty, M, HALF, K,
                 GROUP: gl.constexpr, FUSED: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Warp-specialised consumer (the kernel's warps): wgmma over each ring slot as it fills, the slot released
    once its wgmma is done, then the tile's epilogue while the producer keeps loading the next tile."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_2N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = BLOCK_2N // 2
    NUM_BUF: gl.constexpr = x_bufs.type.shape[0]
    acc_layout: gl.constexpr = _acc_layout(BLOCK_M, BLOCK_2N, NUM_WARPS)
    n_m, n_n, k_steps, first_tile, n_programs, tiles = _schedule(M, HALF, K, BLOCK_M, BLOCK_N, BLOCK_K)
    for t in range(tiles):
        acc = gl.zeros((BLOCK_M, BLOCK_2N), dtype=gl.float32, layout=acc_layout)  # per tile: dead after the epilogue
        for kk in range(k_steps):
            step = t * k_steps + kk
            slot = step % NUM_BUF
            mbarrier.wait(ready.index(slot), (step // NUM_BUF) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((step + NUM_BUF - 1) % NUM_BUF), count=1, pred=kk > 0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        last = t * k_steps + k_steps - 1
        mbarrier.arrive(empty.index(last % NUM_BUF), count=1)
        pid_m, pid_n = _tile_of(last, k_steps, first_tile, n_programs, n_m, n_n, GROUP)
        _store_tile(acc, staging, out_desc, act_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, HALF, FUSED)
    tma.store_wait(pendings=0)


@gluon.jit
def _gated_gemm_ws_kernel(x_desc, w_desc, out_desc, act_desc, M, HALF, K, NUM_BUF: gl.constexpr,
                          GROUP: gl.constexpr, FUSED: gl.constexpr, num_warps: gl.constexpr):
    """_gated_gemm_kernel's product with loads in a producer warp of their own (warp specialisation): the consumer
    warps never wait on a load they could have issued earlier, and a tile's epilogue no longer delays the next
    tile's loads."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_2N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_2N, BLOCK_K], w_desc.layout)
    staging = gl.allocate_shared_memory(dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_consumer, (x_desc, w_desc, out_desc, act_desc, x_bufs, w_bufs, staging, ready, empty, M, HALF, K,
                        GROUP, FUSED, num_warps)),
        (_ws_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, M, HALF, K, GROUP)),
    ], [1], [WS_LOADER_REGS])


def interleave(w: torch.Tensor, block_n: int) -> torch.Tensor:
    """[W_gate; W_up] rows reordered as gate block 0, up block 0, gate block 1, ... (blocks of block_n rows): a
    layout the model could keep for its packed gate_up weight."""
    two_i, k = w.shape
    return w.view(2, two_i // 2 // block_n, block_n, k).transpose(0, 1).reshape(two_i, k).contiguous()


def _descriptor(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def _descriptors(x, w, gate_up, act, config):
    block_m, block_n, block_k = config[:3]
    chunk = block_n // 2 if len(config) > 5 and config[5] else block_n  # config[5]: subtiled epilogue
    return (_descriptor(x, [block_m, block_k]), _descriptor(w, [2 * block_n, block_k]),
            _descriptor(gate_up, [block_m, chunk]), _descriptor(act, [block_m, chunk]))


def gated_gemm(x, w_il, gate_up, act, config, n_sms: int, fused: bool = True, ws: bool = False) -> None:
    """w_il: the packed [W_gate; W_up] weight as interleave(w, BLOCK_N) orders it."""
    m, k = x.shape
    half = w_il.shape[0] // 2
    block_m, block_n, _, num_buf, warps = config[:5]
    assert half % block_n == 0, "a tile must not straddle the gate and up halves"
    tiles = triton.cdiv(m, block_m) * (half // block_n)
    args = (*_descriptors(x, w_il, gate_up, act, config), m, half, k, num_buf, GROUP_M, fused)
    if ws:
        _gated_gemm_ws_kernel[(min(tiles, n_sms),)](*args, num_warps=warps, maxnreg=WS_MAXNREG)
    else:
        _gated_gemm_kernel[(min(tiles, n_sms),)](*args, num_warps=warps)


def compile_only(config, shape, fused: bool = True, ws: bool = False) -> str:
    """Compile for sm_90 without a GPU; report registers, spills and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    tokens, hidden, inter = shape
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    w = torch.empty(2 * inter, hidden, dtype=torch.bfloat16)
    gate_up = torch.empty(tokens, 2 * inter, dtype=torch.bfloat16)
    act = torch.empty(tokens, inter, dtype=torch.bfloat16)
    descs = _descriptors(x, w, gate_up, act, config)
    names = ["x_desc", "w_desc", "out_desc", "act_desc"]
    signature = {n: mangle_type(d) for n, d in zip(names, descs)}
    signature.update(M="i32", HALF="i32", K="i32", NUM_BUF="constexpr", GROUP="constexpr", FUSED="constexpr",
                     num_warps="constexpr")
    constexprs = {"NUM_BUF": config[3], "GROUP": GROUP_M, "FUSED": fused, "num_warps": config[4]}
    src = GluonASTSource(_gated_gemm_ws_kernel if ws else _gated_gemm_kernel, signature, constexprs)
    options = {"num_warps": config[4], **({"maxnreg": WS_MAXNREG} if ws else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
    res = " ".join(line.strip() for line in usage.splitlines() if "REG" in line)
    mix = {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "UTMASTG", "STS", "SYNCS", "BAR")}
    return f"{config} fused={fused} ws={ws}: shared {compiled.metadata.shared} B; {res}; SASS {mix}"


def probe(name: str, tokens: int, hidden: int, inter: int, modes: tuple[str, ...] = ("ws",)) -> dict:
    from triton.testing import do_bench

    from liger_models.kernels.gated_mlp import gated_forward

    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, gate_up, act, want_gu, want_act = mlp_inputs(tokens, hidden, inter)

    def cublas():
        torch.mm(x, w.t(), out=gate_up)

    def gated_kernel():
        gated_forward(gate_up[:, :inter], gate_up[:, inter:], act, "silu")

    row = {"shape": name, "tokens": tokens, "hidden": hidden, "inter": inter, "cublas_ms": do_bench(cublas),
           "gated_kernel_ms": do_bench(gated_kernel), "gluon": []}
    weights = {}

    def interleaved(config):
        return weights.setdefault(config[1], interleave(w, config[1]))

    for fused, config, mode in itertools.product((True, False), CONFIGS, modes):
        ws = mode == "ws"
        gate_up.fill_(float("nan"))
        act.fill_(float("nan"))
        case = {"config": config, "fused": fused, "mode": mode}
        try:
            gated_gemm(x, interleaved(config), gate_up, act, config, n_sms, fused, ws)
            torch.cuda.synchronize()
        except Exception as err:  # a config that does not fit (shared memory, registers) or fails to compile
            row["gluon"].append({**case, "error": f"{type(err).__name__}: {err}"[:300]})
            continue
        errs = {"rel_err_gate_up": rel_err(gate_up, want_gu)}
        if fused:
            errs["rel_err_act"] = rel_err(act, want_act)
        w_il = interleaved(config)
        ms = do_bench(lambda: gated_gemm(x, w_il, gate_up, act, config, n_sms, fused, ws))
        row["gluon"].append({**case, "ms": ms, **errs})
    for fused, key in ((True, "gluon_best"), (False, "gluon_plain_best")):
        ok = [r for r in row["gluon"] if r["fused"] == fused and "ms" in r
              and max(r["rel_err_gate_up"], r.get("rel_err_act", 0.0)) < 1e-2]
        row[key] = min(ok, key=lambda r: r["ms"]) if ok else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--modes", default="ws", help="ws (warp-specialised), pipelined, or both, comma-separated")
    args = parser.parse_args()
    if args.compile_only:
        for config, fused, ws in itertools.product(CONFIGS, (True, False), (True, False)):
            try:
                print(compile_only(config, SHAPES["llama-3.2-1b"], fused, ws), flush=True)
            except Exception as err:
                print(f"{config}: {type(err).__name__}: {err}"[:3000], flush=True)
        return
    rows = []
    print(f"{'shape':16} {'cuBLAS':>8} {'gated':>8} {'sum':>8} {'fused':>8} {'plain':>8}   ms; best configs")
    for name in args.shapes.split(","):
        row = probe(name, *SHAPES[name], modes=tuple(args.modes.split(",")))
        rows.append(row)
        best, plain = row["gluon_best"] or {}, row["gluon_plain_best"] or {}
        print(f"{name:16} {row['cublas_ms']:8.3f} {row['gated_kernel_ms']:8.3f} "
              f"{row['cublas_ms'] + row['gated_kernel_ms']:8.3f} {best.get('ms', float('nan')):8.3f} "
              f"{plain.get('ms', float('nan')):8.3f}   {best.get('config')} {best.get('mode')}, "
              f"{plain.get('config')} {plain.get('mode')}", flush=True)
        for r in row["gluon"]:
            if "error" in r:
                print(f"    {r['config']} {r['mode']} fused={r['fused']}: {r['error'][:200]}", flush=True)
    write_rows(args.out, "gluon_gated_gemm_probe.json", rows)


if __name__ == "__main__":
    main()
