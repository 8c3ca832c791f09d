"""The cross-entropy row kernel at the chunk shapes linear-CE hands it inside a training step (issue 6).

profile_e2e.py put Gemma-2B's 8 CE passes (2048 rows × 256000, one per linear-CE chunk) at 1.18 ms each, while
the kernel takes 1.28 ms for 4096 such rows in bench_cross_entropy.py: per row, almost twice as slow. This times
the pass exactly as linear-CE's forward runs it (loss, lse and q written, the gradient written over the logits,
scaled by a device scalar) at 256-8192 rows of 128256 and 256000 columns, GPU time with the host hidden, with the
row kernel's pass-1 body at its default and forced each way (per-thread lane sums, per-block sums).

    python benchmarks/ce_chunk_rows.py [--out DIR]
"""

from __future__ import annotations

import json
import os

import torch
from harness import busy_gpu_ms, copy_bandwidth_gbs, parse_args

ROWS = (256, 512, 1024, 2048, 4096, 8192)
VOCABS = (128256, 256000)


def ce_pass(rows: int, vocab: int):
    from liger_models.kernels._ce_core import ce_rows
    from liger_models.kernels._labels import LabelCheck

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    loss, lse, q = (torch.empty(rows, device="cuda") for _ in range(3))
    check = LabelCheck(labels, vocab, -100, "mean")

    def run():  # the gradient overwrites the logits: later reps read gradients, the same bytes and work
        ce_rows(logits, labels, grad=logits, loss=loss, lse=lse, q=q, rank=None, scale=check.scale,
                ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, label_flag=check.flag)

    return run


def main() -> None:
    args = parse_args(__doc__)
    import liger_models.kernels._ce_core as core

    copy = copy_bandwidth_gbs()
    tunables = ("CE_LANE_SUMS", "CE_LANE_SUMS_MIN_ROWS")
    defaults = [getattr(core, name) for name in tunables]
    rows_out = []
    for vocab in VOCABS:
        for rows in ROWS:
            fn = ce_pass(rows, vocab)
            row = {"rows": rows, "vocab": vocab}
            for name, values in (("default", defaults), ("lane sums", (True, 0)), ("block sums", (False, 0))):
                for tunable, value in zip(tunables, values):
                    setattr(core, tunable, value)
                row[name] = busy_gpu_ms(fn)
            for tunable, value in zip(tunables, defaults):
                setattr(core, tunable, value)
            row["us_per_row"] = 1e3 * row["default"] / rows
            row["frac_copy"] = 4 * rows * vocab / (row["default"] * 1e-3) / 1e9 / copy  # read + write, 2 B each
            rows_out.append(row)
            del fn
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ce_chunk_rows.json"), "w") as f:
        json.dump({"copy_gbs": copy, "rows": rows_out}, f, indent=1)
    print(f"copy {copy:.0f} GB/s; CE pass (forward + in-place gradient), GPU ms")
    print("| rows × V | default | lane sums | block sums | µs per row | read+write ÷ copy rate |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']}×{r['vocab']} | {r['default']:.3f} | {r['lane sums']:.3f} | {r['block sums']:.3f} "
              f"| {r['us_per_row']:.3f} | {r['frac_copy']:.2f} |")


if __name__ == "__main__":
    main()
