"""Time linear-CE's gradient-filter pass (liger_models/kernels/_grad_filter.active_columns: one read of a chunk's dlogits) at the
chunk shapes linear-CE feeds it, for a few tile shapes: the pass alone (GB/s against the ~4.2 TB/s copy rate) and
with the nonzero() and host sync that size the GEMMs. GPU only.

--dense-share: where the sparse path stops paying. For one chunk (rows × H × V), the kept-column GEMMs
(_grad_filter.sparse_gradients: gathers, GEMMs over the kept columns, dW rows scattered back) against the dense
GEMMs the chunk would run instead (grad_h = dlogits·W, fp32 dW += dlogitsᵀ·h), for a range of kept shares. The
filter pass itself runs before either, so it is left out of both. TUNING.dense_share should sit below the crossing.

    python benchmarks/tools/tune_grad_filter.py [--out DIR] [--dense-share]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from triton.testing import do_bench

from liger_models.kernels.ops import _grad_filter as gf
from liger_models.kernels._tuning import tuned
from liger_models.kernels.ops.fused_linear_cross_entropy import _accumulate_dw

CHUNKS = [(2048, 128256), (2048, 256000), (4096, 128256)]
# (chunk rows, H, V): the H2048 headline shapes' chunks (2048 rows: grad_W's storage as the scratch), and a
# 4096-row chunk at H4096 (the H4096 headline shape runs as one 8192-row chunk)
GEMM_CHUNKS = [(4096, 4096, 128256), (2048, 2048, 256000), (2048, 2048, 128256)]
SHARES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
TILES = [(32, 128, 4), (16, 128, 4), (64, 128, 8), (32, 256, 8), (8, 512, 4), (16, 512, 8)]


def dense_share_sweep() -> list[dict]:
    rows = []
    for m, hdim, v in GEMM_CHUNKS:
        gen = torch.Generator(device="cuda").manual_seed(m + hdim + v)
        d = (torch.randn(m, v, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
        w = torch.randn(v, hdim, device="cuda", generator=gen, dtype=torch.bfloat16)
        h = torch.randn(m, hdim, device="cuda", generator=gen, dtype=torch.bfloat16)
        grad_h = torch.empty(m, hdim, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(v, hdim, device="cuda", dtype=torch.float32)

        def dense():
            torch.mm(d, w, out=grad_h)
            _accumulate_dw(acc, d, h, first=False)

        dense_ms = do_bench(dense)
        for share in SHARES:
            # kept columns spread over the vocabulary, sorted as active_columns returns them
            cols = torch.randperm(v, device="cuda", generator=gen)[: int(share * v)].sort().values
            sparse_ms = do_bench(lambda: gf.sparse_gradients(d, cols, w, h, grad_h, [acc], None, _accumulate_dw))
            rows.append(dict(m=m, h=hdim, v=v, share=share, dense_ms=dense_ms, sparse_ms=sparse_ms,
                             ratio=sparse_ms / dense_ms))
            print(f"{m:>5} x {hdim} x {v:>6}  kept {share:4.0%}: sparse {sparse_ms:7.3f} ms, dense {dense_ms:7.3f} ms"
                  f"  ({sparse_ms / dense_ms:.2f}x)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--dense-share", action="store_true", help="time the sparse path against the dense one")
    args = ap.parse_args()
    if args.dense_share:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "grad_filter_dense_share.json"), "w") as f:
            json.dump(dense_share_sweep(), f, indent=1)
        return
    rows = []
    for (m, v), tile in itertools.product(CHUNKS, TILES):
        d = (torch.randn(m, v, device="cuda") * 1e-3).to(torch.bfloat16)  # random: every column kept
        scale = torch.tensor(1.0, device="cuda")
        with tuned(gf, block_m=tile[0], block_v=tile[1], num_warps=tile[2]):
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
