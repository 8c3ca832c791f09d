"""Where the row-norm time goes (liger_models/kernels/ops/rms_norm.py) on the GPU, and which tiling knobs are best.

Sections (bf16, llama casting; GB/s counts 4 B/elem forward (x, y), 6 B/elem backward (dy, x, dx)):
  ref    minimal kernels written here, GPU time: one row per program forward; persistent backward with dW in
         registers and no prefetch (1 row per iteration) at 1–4 programs per SM: the yardstick.
  sweep  GPU time of norm_forward / norm_backward per shape and tiling knob (tile elements × elements per thread
         → BLOCK_M, num_warps; backward grid in programs per SM, "occ" = measured occupancy).
  wide   rows of 8K-16K columns, RMSNorm and LayerNorm: the one-kernel wide backward (elements per thread, L2
         hints) against the split path, plus the forward for scale; 8192 columns also forced through the wide kernel.
  host   host µs per call, GPU idle (tiny tensors): allocation, Triton launch through its launcher vs the cached
         compiled kernel (liger_models/kernels/_launch.py's fast_launch setting), autograd.grad alone, a whole forward + backward.
  e2e    forward + backward through autograd.grad, timed like benchmarks/bench_rms_norm.py (do_bench median,
         host overhead included), launch path on/off, vs liger-kernel and torch.compile.
"GPU time" keeps the stream busy (torch.cuda._sleep) while the host enqueues the call, so the events bracket
kernels only; at small sizes the e2e numbers are host time, which is why both are reported.

    python benchmarks/tools/tune_norms.py [--quick] [--out DIR] [--sections ref,sweep,host,e2e]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

import liger_models.kernels._launch as fast
import liger_models.kernels.ops.rms_norm as rn
from liger_models.kernels._tuning import set_tuning

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from harness import SLEEP_CYCLES, busy_gpu_ms, copy_bandwidth_gbs, host_ms_per_call, median_ms  # noqa: E402

EPS = 1e-6
KNOBS = ("fwd_tile", "fwd_elems_per_thread", "bwd_tile", "bwd_elems_per_thread", "programs_per_sm",
         "split_block_n", "max_fused_bwd_n", "wide_bwd", "wide_chunk", "wide_elems_per_thread",
         "wide_l2_hints_min_chunks", "wide_ln_elems_per_thread", "wide_ln_max_chunks",
         "wide_ln_l2_hints_min_chunks")
HEADLINE = (16384, 4096)
# shape -> (forward (tile, elems/thread) list, backward (tile, elems/thread) list, programs-per-SM list)
SWEEP = {
    HEADLINE: ([(4096, 16), (8192, 32)], [(4096, 16), (4096, 32)], [None, 3]),
    (16384, 1024): ([(4096, 16), (2048, 16), (1024, 8)], [(4096, 16), (2048, 8), (1024, 8)], [None, 4]),
    (4096, 16384): ([(4096, 16)], [(4096, 16)], [None]),
}
E2E_SHAPES = [(4096, 1024), HEADLINE]
ADD_SHAPES = [HEADLINE]


@triton.jit
def _ref_fwd_kernel(X, W, Y, RSTD, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, (w * (x * rstd).to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty),
             mask=m)
    tl.store(RSTD + row, rstd)


@triton.jit
def _ref_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, n_rows, n_cols, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    m = cols < n_cols
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    row = pid.to(tl.int64)
    while row < n_rows:
        dy = tl.load(DY + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        x = tl.load(X + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols)) * rstd
        tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=m)
        row += tl.num_programs(0)
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=m)


@triton.jit
def _touch_kernel(A, B, C, D, E, F, G, H, I, J, K, n, N_PTRS: tl.constexpr):
    # Writes one element: a launch with 2 or 11 pointer arguments and nothing else to time.
    if N_PTRS > 2:
        tl.store(A + n, tl.load(K + n))
    else:
        tl.store(A + n, tl.load(B + n))


def _add(out: list, r: dict) -> None:
    """Record a result and print it at once (a run cut short by the time limit still shows what it measured)."""
    out.append(r)
    print(f"  {r['sec']} {r['shape']} {r['what']}: {r['ms']:.4f} ms", flush=True)


def _host_ms(fn, n: int = 200, busy: bool = False) -> float:
    """Host time per call of ``fn`` (enqueue only). busy: the GPU is kept busy meanwhile, else it idles."""
    return host_ms_per_call(fn, n, busy_cycles=SLEEP_CYCLES * 50 if busy else 0)


def _inputs(rows: int, hidden: int, grad: bool = False):
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_(grad)
    return x, w, torch.randn_like(x)


def _fwd(x, w):
    return rn.norm_forward(x, None, w, None, EPS, 0.0, center=False, gemma=False)


def _bwd(dy, x, w, rstd):
    return rn.norm_backward(dy, x, w, None, rstd, None, 0.0, center=False, gemma=False, need_dw=True,
                            need_db=False)


def _set(**knobs) -> None:
    """Set rms_norm tiling knobs (fields of its TUNING); no arguments: restore the defaults (and the fast launch
    path)."""
    set_tuning(rn, **(knobs or DEFAULTS))
    set_tuning(fast, fast_launch=True)


def ref_section(out: list) -> None:
    rows, hidden = HEADLINE
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, dy = _inputs(rows, hidden)
    y, rstd, dx = torch.empty_like(x), torch.empty(rows, device="cuda"), torch.empty_like(x)
    for nw in (4, 8):
        ms = busy_gpu_ms(lambda: _ref_fwd_kernel[(rows,)](x, w, y, rstd, hidden, EPS, BLOCK_N=hidden, num_warps=nw))
        _add(out, dict(sec="ref", shape=f"{rows}x{hidden}", what=f"fwd 1 row/prog w{nw}", ms=ms, per=4))
    for pps in (2, 3, 4):
        part = torch.empty(pps * n_sm, hidden, device="cuda")
        ms = busy_gpu_ms(lambda: _ref_bwd_kernel[(pps * n_sm,)](dy, x, w, rstd, dx, part, rows, hidden, BLOCK_N=hidden,
                                                            num_warps=8))
        _add(out, dict(sec="ref", shape=f"{rows}x{hidden}", what=f"bwd no prefetch w8 pps{pps}", ms=ms, per=6))


def sweep_section(out: list, quick: bool) -> None:
    for (rows, hidden), (fwd_cfgs, bwd_cfgs, pps_list) in list(SWEEP.items())[:1 if quick else None]:
        x, w, dy = _inputs(rows, hidden)
        rstd = _fwd(x, w)[3]
        shape = f"{rows}x{hidden}"
        for tile, ept in fwd_cfgs:
            _set(fwd_tile=tile, fwd_elems_per_thread=ept)
            _, bm, _, nw = rn._tiling(rows, hidden, rn.TUNING.max_fused_fwd_n, tile, ept)
            _add(out, dict(sec="sweep", shape=shape, what=f"fwd bm{bm} w{nw}", ms=busy_gpu_ms(lambda: _fwd(x, w)),
                           per=4))
        for (tile, ept), pps in [(c, p) for c in bwd_cfgs for p in pps_list]:
            _set(bwd_tile=tile, bwd_elems_per_thread=ept, programs_per_sm=pps)
            split, bm, bn, nw = rn._tiling(rows, hidden, rn.TUNING.max_fused_bwd_n, tile, ept)
            _add(out, dict(sec="sweep", shape=shape, what=f"bwd bm{bm} bn{bn} w{nw} pps{pps or 'occ'}"
                           + (" split" if split else ""), ms=busy_gpu_ms(lambda: _bwd(dy, x, w, rstd)), per=6))
        _set()
        print(f"swept {shape} ({time.time() - T0:.0f} s)", flush=True)


WIDE_SHAPES = [(16384, 16384), (4096, 16384), (8192, 12288), (16384, 8192)]


def _wide_variants(hidden: int) -> list:
    variants = [("bwd default", {}), ("bwd split", dict(wide_bwd=False))]
    if hidden <= rn.TUNING.max_fused_bwd_n:
        variants = [("bwd default (fused row)", {})]
    return variants + [(f"bwd wide ept{ept} hints{int(hints)}",
                        dict(max_fused_bwd_n=min(rn.TUNING.max_fused_bwd_n, hidden // 2), wide_elems_per_thread=ept,
                             wide_ln_elems_per_thread=ept, wide_ln_max_chunks=4,
                             wide_l2_hints_min_chunks=0 if hints else 99,
                             wide_ln_l2_hints_min_chunks=0 if hints else 99))
                       for ept, hints in [(4, False), (4, True), (8, False), (8, True)]]


def wide_section(out: list) -> None:
    """RMSNorm (llama casting) and LayerNorm with bias (dW and dB) backward at 8K-16K columns, per variant."""
    for rows, hidden in WIDE_SHAPES:
        x, w, dy = _inputs(rows, hidden)
        b = torch.zeros_like(w)
        for op in ("rms_norm", "layer_norm"):
            center = op == "layer_norm"
            shape = f"{op} {rows}x{hidden}"
            fwd = lambda: rn.norm_forward(x, None, w, b if center else None, EPS, 0.0, center=center,  # noqa: E731
                                          gemma=False)
            _, _, mean, rstd = fwd()
            bwd = lambda: rn.norm_backward(dy, x, w, mean, rstd, None, 0.0, center=center,  # noqa: E731
                                           gemma=False, need_dw=True, need_db=center)
            _add(out, dict(sec="wide", shape=shape, what="fwd (default)", ms=busy_gpu_ms(fwd), per=4))
            for what, knobs in _wide_variants(hidden):
                _set(**{**DEFAULTS, **knobs})
                try:
                    _add(out, dict(sec="wide", shape=shape, what=what, ms=busy_gpu_ms(bwd), per=6))
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                    print(f"{shape} {what}: {type(e).__name__}: {e}"[:300], flush=True)
            _set()
        print(f"wide {rows}x{hidden} ({time.time() - T0:.0f} s)", flush=True)


def _liger(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _peers(add: bool) -> dict:
    """name -> norm(x, w) (or add_norm(x, res, w)) for liger-kernel (when installed) and torch.compile."""
    peers = {}
    try:
        if add:
            fn = _liger("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
            peers["liger"] = lambda x_, r_, w_: fn.apply(x_, r_, w_, EPS, 0.0, "llama", False)
        else:
            fn = _liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
            peers["liger"] = lambda x_, w_: fn.apply(x_, w_, EPS, 0.0, "llama", False)
    except ImportError:
        print("liger_kernel missing: skipped")

    def reference(*a):
        if add:
            r = a[0] + a[1]
            return rn.rms_norm_reference(r, a[2], EPS), r
        return rn.rms_norm_reference(a[0], a[1], EPS)

    peers["compile"] = torch.compile(reference, dynamic=False)
    return peers


def host_section(out: list) -> None:
    a = torch.zeros(4096, device="cuda")
    small = torch.empty(64, 1024, device="cuda", dtype=torch.bfloat16)
    ptrs = [torch.zeros(16, device="cuda") for _ in range(11)]
    micro = {
        "torch.empty": lambda: torch.empty(64, 1024, device="cuda", dtype=torch.bfloat16),
        "current_device": torch.cuda.current_device,
        "torch add_ (1 kernel)": lambda: a.add_(1),
        "small.data_ptr x11": lambda: [small.data_ptr() for _ in range(11)],
    }
    for n_ptrs in (2, 11):
        for cached in (False, True):
            def touch(n_ptrs=n_ptrs, cached=cached):
                set_tuning(fast, fast_launch=cached)
                fast.launch(_touch_kernel, (1,), [*ptrs[:n_ptrs], *[None] * (11 - n_ptrs), 3],
                            dict(N_PTRS=n_ptrs, num_warps=1))
            micro[f"triton launch {n_ptrs} ptrs {'cached' if cached else 'jit'}"] = touch

    class _Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    xg, w, dy = _inputs(64, 1024, grad=True)
    micro["autograd.grad identity (0 kernels)"] = lambda: torch.autograd.grad(_Identity.apply(xg), xg, dy)
    micro["autograd.grad x*2 (2 kernels)"] = lambda: torch.autograd.grad(xg * 2, xg, dy)
    x, _, _ = _inputs(64, 1024)
    rstd = _fwd(x, w.detach())[3]
    for cached in (False, True):
        def fwd(cached=cached):
            set_tuning(fast, fast_launch=cached)
            _fwd(x, w.detach())

        def bwd(cached=cached):
            set_tuning(fast, fast_launch=cached)
            _bwd(dy, x, w.detach(), rstd)

        def both(cached=cached):
            set_tuning(fast, fast_launch=cached)
            torch.autograd.grad(rn.rms_norm(xg, w, EPS), (xg, w), dy)
        tag = "cached" if cached else "jit"
        micro.update({f"norm_forward {tag}": fwd, f"norm_backward {tag}": bwd, f"rms_norm fwd+bwd {tag}": both})
    for name, norm in _peers(add=False).items():
        micro[f"{name} fwd+bwd"] = lambda norm=norm: torch.autograd.grad(norm(xg, w), (xg, w), dy)
    for name, fn in micro.items():
        _add(out, dict(sec="host", shape="64x1024", what=name, ms=_host_ms(fn)))
    for name in ("triton launch 2 ptrs jit", "torch add_ (1 kernel)", "rms_norm fwd+bwd cached"):
        _add(out, dict(sec="host", shape="64x1024", what=name + " (GPU busy)", ms=_host_ms(micro[name], busy=True)))
    _set()


def e2e_section(out: list) -> None:
    for add in (False, True):
        for rows, hidden in ADD_SHAPES if add else E2E_SHAPES:
            x, w, dy = _inputs(rows, hidden, grad=True)
            res, dr = torch.randn_like(x).requires_grad_(), torch.randn_like(dy)
            impls = {"ours jit": rn.add_rms_norm if add else rn.rms_norm, "ours cached": None, **_peers(add)}
            for name, fn in impls.items():
                set_tuning(fast, fast_launch=name != "ours jit")
                fn = fn or impls["ours jit"]
                if add:
                    def step(fn=fn):
                        return torch.autograd.grad(fn(x, res, w), (x, res, w), (dy, dr))
                else:
                    def step(fn=fn):
                        return torch.autograd.grad(fn(x, w), (x, w), dy)
                step()
                shape = f"{'add ' if add else ''}{rows}x{hidden}"
                _add(out, dict(sec="e2e", shape=shape, what=name, ms=median_ms(step), per=16 if add else 10))
                if name == "ours cached":
                    _add(out, dict(sec="e2e-gpu", shape=shape, what=name, ms=busy_gpu_ms(step), per=16 if add else 10))
            _set()
            print(f"e2e {rows}x{hidden} ({time.time() - T0:.0f} s)", flush=True)


def main() -> None:
    global DEFAULTS, T0
    T0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--quick", action="store_true", help="headline shape only in the sweep")
    ap.add_argument("--sections", default="ref,sweep,host,e2e")
    args = ap.parse_args()
    DEFAULTS = {k: getattr(rn.TUNING, k) for k in KNOBS}
    copy_gbs = copy_bandwidth_gbs()
    results: list = []
    sections = {"ref": ref_section, "sweep": lambda o: sweep_section(o, args.quick), "wide": wide_section,
                "host": host_section, "e2e": e2e_section}
    for name in args.sections.split(","):
        sections[name](results)
        print(f"{name} done ({time.time() - T0:.0f} s)", flush=True)
    for r in results:
        rows, hidden = (int(v) for v in r["shape"].split()[-1].split("x"))
        r["gbs"] = r.pop("per", 0) * rows * hidden / (r["ms"] * 1e-3) / 1e9
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_norms.json"), "w") as f:
        json.dump({"copy_bandwidth_gbs": copy_gbs, "defaults": DEFAULTS, "results": results}, f, indent=1)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; defaults {DEFAULTS}; total {time.time() - T0:.0f} s")
    print("| section | shape | what | ms | GB/s | frac copy |")
    print("|---|---|---|---|---|---|")
    for r in results:
        bw = f"{r['gbs']:.0f} | {r['gbs'] / copy_gbs:.2f}" if r["gbs"] else "— | —"
        print(f"| {r['sec']} | {r['shape']} | {r['what']} | {r['ms']:.4f} | {bw} |")


DEFAULTS: dict = {}
T0 = 0.0

if __name__ == "__main__":
    main()
