"""Decoding attention at the shapes of graphed decoding calls: SDPA with the mask vs liger_models/kernels/ops/decode_attention.py.

Each case is one layer's attention of a graphed call, built as the call builds it: q as a transposed view of the
projection output, k / v as one layer's views of the static cache, the mask from `device_mask` (a Medusa tree of
45 nodes from the default 5-head choices, or one token) over `capacity` slots of which `past` are filled. Times are
GPU times of CUDA-graph replays (`triton.testing.do_bench_cudagraph`): inside a graphed step there is no host.

Every schedule of the split kernel in SCHEDULES (rows per program, warps, programs per SM) is timed and checked
against the float64 reference (docs/kernels.md#correctness-protocol: bf16 rel. L2 ≤ 1e-2 and ≤ 2× SDPA's error);
the fastest correct one over the tree cases is printed as a LIGER_TUNE string (`best_tune` in the JSON), with whether
one-token calls are faster through SDPA (then min_queries=2).

    python benchmarks/bench_decode_attention.py --out DIR
"""

from __future__ import annotations

import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

# (name, Hq, Hkv, head_dim, tree, capacity, past): Llama-3-8B and Llama-3.2-1B attention, batch 1.
CASES = [("8B tree, 128 past", 32, 8, 128, True, 253, 128), ("8B tree, 2K past", 32, 8, 128, True, 2173, 2048),
         ("8B tree, 8K past", 32, 8, 128, True, 8317, 8192), ("1B tree, 2K past", 32, 8, 64, True, 2173, 2048),
         ("8B one token, 2K past", 32, 8, 128, False, 2129, 2048),
         ("1B one token, 2K past", 32, 8, 64, False, 2129, 2048)]
SCHEDULES = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 4, 8)))  # block_m_max, num_warps, programs_per_sm


def _case(Hq, Hkv, D, tree, capacity, past, dtype):
    import torch

    from liger_models.medusa.decoding import default_medusa_choices, generate_medusa_buffers
    from liger_models.modules.graphed_decoding import device_mask

    if tree:
        b = generate_medusa_buffers(default_medusa_choices(5), 5, device="cuda")
        pattern, depth = b.tree_mask, b.tree_position_ids
    else:
        pattern = torch.ones(1, 1, dtype=torch.bool, device="cuda")
        depth = torch.zeros(1, dtype=torch.long, device="cuda")
    T = pattern.shape[0]
    mask = device_mask(torch.tensor(past, device="cuda"), pattern, depth, capacity, None).boolean(None)
    qkv = torch.randn(1, T, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype)
    q = qkv[..., : Hq * D].view(1, T, Hq, D).transpose(1, 2)
    cache = torch.randn(4, 2, 1, Hkv, capacity, D, device="cuda", dtype=dtype)
    return q, cache[2, 0], cache[2, 1], mask, D ** -0.5


def main() -> None:
    import torch
    import torch.nn.functional as F
    import triton.testing

    from liger_models.kernels.ops import decode_attention as da
    from liger_models.kernels._tuning import tuned

    def rel_l2(out, ref) -> float:
        return ((out.double() - ref).norm() / ref.norm()).item()

    args = harness.parse_args(__doc__.splitlines()[0])
    rows = []
    for (name, Hq, Hkv, D, tree, capacity, past), dtype in itertools.product(CASES, (torch.bfloat16,)):
        q, k, v, mask, scale = _case(Hq, Hkv, D, tree, capacity, past, dtype)
        ref = da.decode_attention_reference(q.double(), k.double(), v.double(), mask, scale)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)  # noqa
        sdpa_err = rel_l2(sdpa(), ref)
        row = dict(case=name, tree=tree, capacity=capacity, past=past, head_dim=D,
                   sdpa_us=1e3 * triton.testing.do_bench_cudagraph(sdpa, rep=50), sdpa_err=sdpa_err, ours={})
        for block_m, warps, per_sm in SCHEDULES:
            ours = lambda: da.decode_attention(q, k, v, mask, scale)  # noqa: E731
            with tuned(da, block_m_max=block_m, num_warps=warps, programs_per_sm=per_sm):
                try:
                    err = rel_l2(ours(), ref)
                    ok = err <= 1e-2 and err <= max(2 * sdpa_err, 4e-3)
                    us = 1e3 * triton.testing.do_bench_cudagraph(ours, rep=50)
                except Exception as e:  # noqa: BLE001 - a schedule that does not compile (resources) is just out
                    err, ok, us = repr(e)[:200], False, float("inf")
            row["ours"][f"{block_m},{warps},{per_sm}"] = dict(us=us, err=err, ok=ok)
        rows.append(row)
        best = min(row["ours"].items(), key=lambda kv: kv[1]["us"] if kv[1]["ok"] else float("inf"))
        print(f"{name}: SDPA {row['sdpa_us']:.1f} us (err {sdpa_err:.1e}); ours best {best[0]} "
              f"{best[1]['us']:.1f} us (err {best[1]['err']}); failing schedules: "
              f"{[s for s, r in row['ours'].items() if not r['ok']]}")
    # The schedule with the least summed time over the tree cases, among those correct everywhere.
    correct = [s for s in rows[0]["ours"] if all(r["ours"][s]["ok"] for r in rows)]
    if not correct:
        raise SystemExit("no schedule of decode_attention is correct at every shape: see the failing schedules above")
    trees = [r for r in rows if r["tree"]]
    best = min(correct, key=lambda s: sum(r["ours"][s]["us"] for r in trees))
    one_token_sdpa = all(r["sdpa_us"] < r["ours"][best]["us"] for r in rows if not r["tree"])
    block_m, warps, per_sm = best.split(",")
    tune = (f"decode_attention.block_m_max={block_m},decode_attention.num_warps={warps},"
            f"decode_attention.programs_per_sm={per_sm},decode_attention.min_queries={2 if one_token_sdpa else 1}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_decode_attention.json"), "w") as f:
        json.dump({"env": harness.environment(), "best_tune": tune, "results": rows}, f, indent=1)
    with open(os.path.join(args.out, "decode_attention_tune.txt"), "w") as f:
        f.write(tune)
    default = f"{da.TUNING.block_m_max},{da.TUNING.num_warps},{da.TUNING.programs_per_sm}"
    print("| case | SDPA µs | ours µs (best schedule) | ours µs (current default) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['sdpa_us']:.1f} | {r['ours'][best]['us']:.1f} ({best}) | "
              f"{r['ours'][default]['us'] if default in r['ours'] else float('nan'):.1f} |")
    print(f"best_tune: {tune}")


if __name__ == "__main__":
    main()
