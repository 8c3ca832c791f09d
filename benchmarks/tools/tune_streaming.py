"""Sweep the tiling knobs of the streaming kernels (liger_models/kernels/ops/gated_mlp.py, liger_models/kernels/ops/rope.py) on the GPU.

Gated MLP (swiglu 16384×14336, geglu tanh 16384×16384, packed, fwd+bwd): elements per program (tile) ×
elements per thread (elems_per_thread → num_warps), timed on the same closures as the benchmarks. RoPE
(B4 T4096 Hq32 Hkv8, D 128 and 64): tokens per program (tokens_per_program) × elements per thread, timed on
the forward + backward kernel launches alone (the autograd step is host-bound; see bench_rope.py). Times are
triton do_bench medians; GB/s counts the bytes the op must move. The defaults in the kernel files should be the
best rows.

    python benchmarks/tools/tune_streaming.py [--quick] [--out DIR]
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

import liger_models.kernels.ops.gated_mlp as gm
import liger_models.kernels.ops.rope as rp
from liger_models.kernels._tuning import tuned
from liger_models.kernels.ops.geglu import geglu_packed
from liger_models.kernels.ops.swiglu import swiglu_packed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from bench_rope import kernels_step  # noqa: E402
from bench_swiglu import packed_step  # noqa: E402
from harness import copy_bandwidth_gbs, median_ms, parse_args  # noqa: E402

GATED = [("swiglu 16384x14336", 16384, 14336, swiglu_packed), ("geglu 16384x16384", 16384, 16384, geglu_packed)]
GATED_KNOBS = list(itertools.product((1024, 2048, 4096, 8192), (8, 16, 32)))
ROPE = [(4, 4096, 32, 8, 128), (4, 4096, 32, 8, 64)]
ROPE_KNOBS = list(itertools.product((1, 2, 4), (20, 40, 80)))


def _sweep(module, knobs, names, fn, nbytes, label, copy_gbs, rows) -> None:
    """Time ``fn`` under every knob setting (fields of the module's TUNING), the defaults restored afterwards."""
    defaults = tuple(getattr(module.TUNING, n) for n in names)
    for values in knobs:
        with tuned(module, **dict(zip(names, values))):
            try:
                fn()
                ms = median_ms(fn)
                rows.append({"case": label, **dict(zip(names, values)), "ms": ms,
                             "frac_copy_bw": nbytes / ms / 1e6 / copy_gbs, "default": values == defaults})
            except Exception as e:  # noqa: BLE001 - an invalid config is reported, not fatal
                rows.append({"case": label, **dict(zip(names, values)), "error": f"{type(e).__name__}: {e}"[:200]})


def main() -> None:
    args = parse_args(__doc__)
    copy_gbs = copy_bandwidth_gbs()
    rows: list[dict] = []
    for label, r, i, fn_packed in GATED[:1] if args.quick else GATED:
        _sweep(gm, GATED_KNOBS, ("tile", "elems_per_thread"), packed_step(r, i, fn_packed),
               8 * r * i * 2, label, copy_gbs, rows)
        torch.cuda.empty_cache()
    for b, t, hq, hkv, d in ROPE[:1] if args.quick else ROPE:
        _sweep(rp, ROPE_KNOBS, ("tokens_per_program", "elems_per_thread"), kernels_step(b, t, hq, hkv, d),
               4 * b * t * (hq + hkv) * d * 2, f"rope B{b} T{t} Hq{hq} Hkv{hkv} D{d}", copy_gbs, rows)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_streaming.json"), "w") as f:
        json.dump({"copy_bandwidth_gbs": copy_gbs, "rows": rows}, f, indent=1)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    for case in dict.fromkeys(r["case"] for r in rows):
        ok = sorted((r for r in rows if r["case"] == case and "ms" in r), key=lambda r: r["ms"])
        print(f"\n{case}: best first (* = current default)")
        for r in ok[:6] + [r for r in ok[6:] if r["default"]]:
            knobs = ", ".join(f"{k}={v}" for k, v in r.items() if k.startswith("_"))
            print(f"  {'*' if r['default'] else ' '} {knobs:<40} {r['ms']:.3f} ms  {r['frac_copy_bw']:.2f} of copy bw")
        for r in rows:
            if r["case"] == case and "error" in r:
                print(f"    failed: {r}")


if __name__ == "__main__":
    main()
