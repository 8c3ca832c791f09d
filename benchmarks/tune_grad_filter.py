"""Time linear-CE's gradient-filter pass (kernels/_grad_filter.active_columns: one read of a chunk's dlogits) at the
chunk shapes linear-CE feeds it, for a few tile shapes: the pass alone (GB/s against the ~4.2 TB/s copy rate) and
with the nonzero() and host sync that size the GEMMs. GPU only.

    python benchmarks/tune_grad_filter.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from triton.testing import do_bench

from liger_models.kernels import _grad_filter as gf

CHUNKS = [(2048, 128256), (2048, 256000), (4096, 128256)]
TILES = [(32, 128, 4), (16, 128, 4), (64, 128, 8), (32, 256, 8), (8, 512, 4), (16, 512, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    rows = []
    for (m, v), tile in itertools.product(CHUNKS, TILES):
        d = (torch.randn(m, v, device="cuda") * 1e-3).to(torch.bfloat16)  # random: every column kept
        scale = torch.tensor(1.0, device="cuda")
        gf._BLOCK_M, gf._BLOCK_V, gf._NUM_WARPS = tile
        kernel_ms = do_bench(lambda: gf.column_flags(d, scale, 2.0**-12))  # the pass alone (zeroed flags + kernel)
        call_ms = do_bench(lambda: gf.active_columns(d, scale, 2.0**-12))  # + nonzero and its host sync
        gbps = d.numel() * 2 / (kernel_ms * 1e-3) / 1e9
        rows.append(dict(m=m, v=v, tile=tile, kernel_ms=kernel_ms, call_ms=call_ms, gb_s=gbps))
        print(f"{m:>5} x {v:>6}  tile {tile}:  pass {kernel_ms:.3f} ms ({gbps:4.0f} GB/s), with the sync "
              f"{call_ms:.3f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_grad_filter.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
