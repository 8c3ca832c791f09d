"""Can a gated MLP's activation move into its gate_up GEMM's epilogue and win? (issue 6)

The remaining end-to-end gap (BENCHMARKS.md, "What bounds each end-to-end config") sits in the non-GEMM kernels,
which already run at 60–77% of the copy rate; only fusing them into GEMM epilogues would shrink them further.
cuBLAS has no epilogue for a gated product (gelu(gate)·up), so the fused GEMM would be a Triton one. This probe
measures, at the e2e configs' MLP shapes (N tokens, K = hidden, I = intermediate, bf16):

- `cublas`            gate_up = x · W_guᵀ  (torch.mm, what a step runs now)
- `cublas+act`        that GEMM plus this project's gated forward kernel (reads gate_up, writes act)
- `triton`            the same GEMM as a Triton TMA kernel (persistent or one tile per program; best of a
                      small config sweep), writing gate_up
- `fused`             the Triton GEMM computing a gate tile and its up tile side by side (two accumulators over
                      one x tile) and writing gate, up (kept for the backward) and act = silu(gate)·up
- `interleaved`       the same epilogue over a weight whose gate and up rows alternate in blocks (a layout the
                      model could keep): one accumulator and one dot per K step, as the plain GEMM

The fusion removes one read of gate_up (2·N·I·2 bytes) per layer, so it wins only if `fused` or `interleaved` beats
`cublas+act`. The backward's fusion (d act's GEMM writing d gate_up) has the same GEMM at its core, so the
forward answers for both.

Measured on the H200 (BENCHMARKS.md, twenty-fifth session): Triton does not hide this epilogue. Fused minus plain is
about the gated kernel's own time, and at the configs short of their target fusion won once in 9 tries.
`gluon_gated_gemm_probe.py` takes the question further.

    python benchmarks/gemm_epilogue_probe.py --out DIR [--shapes llama-3.2-1b,gemma-2b]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

# name → (tokens, hidden, intermediate), the bench_e2e configs' batch × seq and MLP widths
SHAPES = {
    "llama-3.2-1b": (16384, 2048, 8192),
    "qwen2.5-1.5b": (16384, 1536, 8960),
    "gemma-2b": (16384, 2048, 16384),
    "llama-3-8b-w8l": (8192, 4096, 14336),
    "phi-3-mini-w8l": (16384, 3072, 8192),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps); BLOCK_N is each half's width for `fused`, both halves' for
# `interleaved`. First calls: 128×256 and 256×128 tiles with 3 stages led; 4 stages of 128×256 do not fit in
# shared memory; 128×128 plain tiles and 128×64 fused halves were 5–30% slower; num_warps must be a power of 2.
CONFIGS = {
    "triton": [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 256, 128, 2, 8)],
    "fused": [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8)],
    "interleaved": [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 256, 128, 2, 8)],
}


@triton.jit
def _tile_coords(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles share each column tile's weight while it is in L2."""
    per_group = GROUP_M * n_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _gemm_kernel(x_desc, w_desc, out_desc, act_desc, M, N, K, HALF_OFFSET, NUM_PROGRAMS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 FUSED: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """out = x · wᵀ over output tiles; FUSED: each tile is gate columns n.. and their up columns HALF_OFFSET + n..,
    and act = silu(gate)·up is written too. N counts output columns (the gate half's width when FUSED)."""
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # FLATTEN lets the pipeliner issue the next tile's loads during this tile's epilogue; WARP_SPECIALIZE gives
    # loads, MMAs and the epilogue their own warps (both Triton ≥ 3.5 on sm90).
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, n_m, n_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            x = x_desc.load([off_m, kt * BLOCK_K])
            acc = tl.dot(x, w_desc.load([off_n, kt * BLOCK_K]).T, acc)
            if FUSED:
                acc_up = tl.dot(x, w_desc.load([HALF_OFFSET + off_n, kt * BLOCK_K]).T, acc_up)
        out_desc.store([off_m, off_n], acc.to(tl.bfloat16))
        if FUSED:
            out_desc.store([off_m, HALF_OFFSET + off_n], acc_up.to(tl.bfloat16))
            gate = acc.to(tl.bfloat16).to(tl.float32)  # the backward recomputes from the stored bf16 values
            act = gate / (1.0 + tl.exp(-gate)) * acc_up.to(tl.bfloat16).to(tl.float32)
            act_desc.store([off_m, off_n], act.to(tl.bfloat16))


@triton.jit
def _gemm_interleaved_kernel(x_desc, w_desc, out_desc, act_desc, M, N, K, NUM_PROGRAMS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The fused GEMM over a weight whose gate and up rows alternate in blocks of BLOCK_N / 2 (interleave()):
    one dot of the full tile width per K step, as the plain GEMM, and the accumulator split in two for the
    epilogue. N counts gate_up's columns (2·I); gate lands in columns [0, I), up in [I, 2·I)."""
    HALF: tl.constexpr = BLOCK_N // 2
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, n_m, n_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            acc = tl.dot(x_desc.load([off_m, kt * BLOCK_K]), w_desc.load([pid_n * BLOCK_N, kt * BLOCK_K]).T, acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        gate, up = gate.to(tl.bfloat16), up.to(tl.bfloat16)
        out_desc.store([off_m, pid_n * HALF], gate)
        out_desc.store([off_m, N // 2 + pid_n * HALF], up)
        g = gate.to(tl.float32)
        act_desc.store([off_m, pid_n * HALF], (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(tl.bfloat16))


def interleave(w: torch.Tensor, half: int) -> torch.Tensor:
    """Rows of a packed [gate; up] weight reordered as gate block 0, up block 0, gate block 1, ... (blocks of
    `half` rows): the layout _gemm_interleaved_kernel reads."""
    two_i, k = w.shape
    return w.view(2, two_i // 2 // half, half, k).transpose(0, 1).reshape(two_i, k).contiguous()


def interleaved_gemm(x, w_il, out, act, config, mode: str) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, stages, warps = config
    m, k = x.shape
    n = w_il.shape[0]
    assert act.shape[1] % (block_n // 2) == 0, "gate and up blocks must tile the intermediate width"
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = _programs(mode, tiles, x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w_il, [block_n, block_k])
    out_desc = TensorDescriptor.from_tensor(out, [block_m, block_n // 2])
    act_desc = TensorDescriptor.from_tensor(act, [block_m, block_n // 2])
    _gemm_interleaved_kernel[(programs,)](x_desc, w_desc, out_desc, act_desc, m, n, k, programs, block_m, block_n,
                                          block_k, 8, mode == "flatten", mode == "warp-specialized",
                                          num_warps=warps, num_stages=stages)


MODES = ("tiles", "persistent", "flatten", "warp-specialized")  # one output tile per program, or a persistent grid


def triton_gemm(x, w, out, act, config, mode: str, fused: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, stages, warps = config
    m, k = x.shape
    assert not fused or act.shape[1] % block_n == 0, "a fused tile must not straddle the gate and up halves"
    n = act.shape[1] if fused else w.shape[0]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = _programs(mode, tiles, x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    out_desc = TensorDescriptor.from_tensor(out, [block_m, block_n])
    act_desc = TensorDescriptor.from_tensor(act, [block_m, block_n]) if fused else out_desc
    _gemm_kernel[(programs,)](x_desc, w_desc, out_desc, act_desc, m, n, k, n if fused else 0, programs,
                              block_m, block_n, block_k, 8, fused, mode == "flatten", mode == "warp-specialized",
                              num_warps=warps, num_stages=stages)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def mlp_inputs(tokens: int, hidden: int, inter: int):
    """x, the packed [W_gate; W_up] weight, empty gate_up and act outputs, and cuBLAS's gate_up with this project's
    act of it: what every candidate must reproduce."""
    from liger_models.kernels.gated_mlp import gated_forward

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    gate_up = torch.empty(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(tokens, inter, device="cuda", dtype=torch.bfloat16)
    want_gu = x @ w.t()
    want_act = torch.empty_like(act)
    gated_forward(want_gu[:, :inter], want_gu[:, inter:], want_act, "silu")
    return x, w, gate_up, act, want_gu, want_act


def _programs(mode: str, tiles: int, device: torch.device) -> int:
    """One program per output tile, or a persistent grid of at most one program per SM."""
    return tiles if mode == "tiles" else min(tiles, torch.cuda.get_device_properties(device).multi_processor_count)


def probe(name: str, tokens: int, hidden: int, inter: int) -> dict:
    from triton.testing import do_bench

    from liger_models.kernels.gated_mlp import gated_forward

    x, w, gate_up, act, want_gu, want_act = mlp_inputs(tokens, hidden, inter)
    flop = 2 * tokens * hidden * 2 * inter

    def cublas():
        torch.mm(x, w.t(), out=gate_up)

    def cublas_act():
        torch.mm(x, w.t(), out=gate_up)
        gated_forward(gate_up[:, :inter], gate_up[:, inter:], act, "silu")

    row = {"shape": name, "tokens": tokens, "hidden": hidden, "inter": inter,
           "cublas_ms": do_bench(cublas), "cublas_act_ms": do_bench(cublas_act)}
    weights = {}

    def run(family, config, mode):
        if family == "interleaved":
            w_il = weights.setdefault(config[1], interleave(w, config[1] // 2))
            interleaved_gemm(x, w_il, gate_up, act, config, mode)
        else:
            triton_gemm(x, w, gate_up, act, config, mode, family == "fused")

    row["tflops"] = {k: flop / row[k + "_ms"] / 1e9 for k in ("cublas", "cublas_act")}
    for family, configs in CONFIGS.items():
        row[family] = []
        for config in configs:
            for mode in MODES:
                gate_up.fill_(float("nan"))
                act.fill_(float("nan"))
                try:
                    run(family, config, mode)
                    torch.cuda.synchronize()
                except Exception as err:  # out of shared memory / registers for this config
                    row[family].append({"config": config, "mode": mode, "error": str(err)[:120]})
                    continue
                err = rel_err(gate_up, want_gu)
                if family != "triton":
                    err = max(err, rel_err(act, want_act))
                ms = do_bench(lambda: run(family, config, mode))
                row[family].append({"config": config, "mode": mode, "ms": ms, "rel_err": err})
        ok = [r for r in row[family] if "ms" in r and r["rel_err"] < 1e-2]
        row[family + "_best"] = best = min(ok, key=lambda r: r["ms"]) if ok else None
        if best:
            row["tflops"][family] = flop / best["ms"] / 1e9
    return row


def write_rows(out: str, name: str, rows: list[dict]) -> None:
    """The probe's rows as JSON under out/, with the versions and GPU they were measured on."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump({"env": {"torch": torch.__version__, "triton": triton.__version__,
                           "gpu": torch.cuda.get_device_name()}, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    rows = []
    print(f"{'shape':16} {'cublas':>8} {'+act':>8} {'triton':>8} {'fused':>8} {'interl.':>8}   ms; best configs")
    for name in args.shapes.split(","):
        row = probe(name, *SHAPES[name])
        rows.append(row)
        best = {k: row[k + "_best"] or {} for k in CONFIGS}
        print(f"{name:16} {row['cublas_ms']:8.3f} {row['cublas_act_ms']:8.3f} "
              + " ".join(f"{best[k].get('ms', float('nan')):8.3f}" for k in CONFIGS)
              + "   " + "; ".join(f"{k} {best[k].get('config')} {best[k].get('mode')}" for k in CONFIGS), flush=True)
    write_rows(args.out, "gemm_epilogue_probe.json", rows)


if __name__ == "__main__":
    main()
