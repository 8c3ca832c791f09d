"""Sweep the row-norm kernels' tiling knobs (kernels/rms_norm.py) on the GPU and print the best per shape.

Forward: tile elements per program × elements per thread (→ BLOCK_M, num_warps). Backward: the same plus the
persistent grid size (programs per SM; "occ" = measured occupancy, the default). Times are medians of
triton's do_bench for norm_forward / norm_backward alone (bf16, llama casting); GB/s counts 4 B/elem forward
(x, y) and 6 B/elem backward (dy, x, dx). The defaults in kernels/rms_norm.py should be the best rows here.

    python benchmarks/tune_norms.py [--quick] [--out DIR]
"""

from __future__ import annotations

import itertools
import json
import os

import torch
from harness import copy_bandwidth_gbs, median_ms, parse_args

import liger_models.kernels.rms_norm as rn

SHAPES = [(16384, 4096), (16384, 1024), (4096, 8192), (4096, 16384)]
FWD = [(4096, 16), (4096, 32), (8192, 16), (8192, 32), (16384, 32), (16384, 64)]
BWD = [(2048, 8), (2048, 16), (4096, 8), (4096, 16), (4096, 32), (8192, 16), (8192, 32)]
PROGRAMS_PER_SM = [None, 1, 2, 3, 4, 8]


def _set(**knobs) -> None:
    for name, value in knobs.items():
        setattr(rn, name, value)


def main() -> None:
    args = parse_args(__doc__)
    defaults = {k: getattr(rn, k) for k in ("_FWD_TILE", "_FWD_ELEMS_PER_THREAD", "_BWD_TILE",
                                            "_BWD_ELEMS_PER_THREAD", "_PROGRAMS_PER_SM")}
    copy_gbs = copy_bandwidth_gbs()
    rows_out = []
    for rows, hidden in SHAPES[:1] if args.quick else SHAPES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
        dy = torch.randn_like(x)
        _, _, _, rstd = rn.norm_forward(x, None, w, None, 1e-6, 0.0, center=False, gemma=False)
        best = {}
        for tile, ept in FWD:
            _set(_FWD_TILE=tile, _FWD_ELEMS_PER_THREAD=ept)
            ms = median_ms(lambda: rn.norm_forward(x, None, w, None, 1e-6, 0.0, center=False, gemma=False))
            rows_out.append(dict(shape=f"{rows}x{hidden}", pass_="fwd", tile=tile, ept=ept, pps=None, ms=ms,
                                 gbs=4 * x.numel() / ms / 1e6))
        for (tile, ept), pps in itertools.product(BWD, PROGRAMS_PER_SM):
            _set(_BWD_TILE=tile, _BWD_ELEMS_PER_THREAD=ept, _PROGRAMS_PER_SM=pps)
            ms = median_ms(lambda: rn.norm_backward(dy, x, w, None, rstd, None, 0.0, center=False, gemma=False,
                                                    need_dw=True, need_db=False))
            rows_out.append(dict(shape=f"{rows}x{hidden}", pass_="bwd", tile=tile, ept=ept, pps=pps or "occ", ms=ms,
                                 gbs=6 * x.numel() / ms / 1e6))
        _set(**defaults)
        for r in rows_out:
            if r["shape"] == f"{rows}x{hidden}" and (r["pass_"] not in best or r["ms"] < best[r["pass_"]]["ms"]):
                best[r["pass_"]] = r
        print(f"{rows}x{hidden}: best " + "; ".join(f"{p} {b['ms']:.4f} ms ({b['gbs']:.0f} GB/s) tile={b['tile']} "
                                                    f"ept={b['ept']} pps={b['pps']}" for p, b in best.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_norms.json"), "w") as f:
        json.dump({"copy_bandwidth_gbs": copy_gbs, "defaults": defaults, "results": rows_out}, f, indent=1)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; defaults {defaults}")
    print("| shape | pass | tile | elems/thread | programs/SM | ms | GB/s | frac copy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows_out, key=lambda r: (r["shape"], r["pass_"], r["ms"])):
        print(f"| {r['shape']} | {r['pass_']} | {r['tile']} | {r['ept']} | {r['pps'] or ''} | {r['ms']:.4f} | "
              f"{r['gbs']:.0f} | {r['gbs'] / copy_gbs:.2f} |")


if __name__ == "__main__":
    main()
