"""LoRA's thin products with each adapter's dropout mask drawn inside the product: the mask is never formed.

A group of sibling adapters (q|k|v, gate|up, or one) reads one input x [N, in]; adapter i has A_i [r_i, in], a
scale-free dropout drop_i(t) = t · keep_i / (1 − p_i) with keep_i from its seed (kernels/ops/dropout.py,
``keep_mask``), and s·dY·B_i = d_i [N, r_i] in backward. With the adapters' A stacked into A_cat [Σr, in] and the
d_i into d_cat [N, Σr], the three products that need the mask are:

  * ``dropped_matmul``:        xa[:, i]  = drop_i(x) · A_iᵀ             (forward; x read once for every adapter)
  * ``dropped_matmul_add``:    out      += Σ_i drop_i(d_i · A_i)         (backward dX, into the base's dY·W)
  * ``dropped_matmul_t``:      dA_cat[i] = d_iᵀ · drop_i(x)              (backward dA, fp32)

Each is one kernel over x's (or out's) tiles that draws every adapter's mask for the tile it holds, so the step
makes no dropped copy of x per adapter and no N × in product per adapter to add afterwards: the elementwise passes
(one in forward, two in backward, per adapter) are gone. Inside a tile each adapter is its own product against the
rows of A_cat (or columns of d_cat) that are its own, the others' zeroed: Σr is at most a few hundred, so the
products are small next to the tile's memory traffic. A launch takes up to ``MAX_ADAPTERS`` adapters of at most
``MAX_LAUNCH_RANK`` summed rank (a group past either is launched in parts).

Rounding: forward rounds drop_i(x) to x's dtype before the product (as the dropped copy was), the products
accumulate in fp32; ``dropped_matmul_add`` sums the products and ``out`` in fp32 and rounds once; ``dropped_matmul_t``
returns fp32. The PyTorch references (``*_reference``) apply the draws' masks (stored or drawn from the seed) to
whole tensors, one adapter at a time: the path of a draw that stores its mask (CPU without the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, pow2, sm_count
from ._dot import dot, dot_flags
from .dropout import GroupDraws, keep_mask, rate_args

MAX_ADAPTERS = 4  # adapters a launch takes (q|k|v is three); a larger group is launched in parts
MAX_LAUNCH_RANK = 256  # and their summed rank (a tile's rank dimension is padded to a power of two, held in registers)


@dataclass(frozen=True)
class DropoutMatmulTuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Tokens per program of dropped_matmul, and columns of x a step (a multiple of 8: the mask's eight columns a
    # Philox call). One H100 at 8192 tokens (2026-12-07, bench_dropout.py): 64 tokens was 5-30% slower, 16 tokens by
    # 128 columns 0-18% slower.
    forward_block_m: int = 32
    forward_block_k: int = 64
    # dropped_matmul_add's tile of out (columns a multiple of 8): 32 × 64 took 0.203 / 0.124 ms at q|k|v / gate|up
    # against 0.232 / 0.153 for 64 × 128 (the same run), o and down unchanged
    add_block_m: int = 32
    add_block_n: int = 64
    # dropped_matmul_t: tokens a step, columns a program (a multiple of 8), and the token splits aimed at per SM:
    # 128 columns and 4 per SM took 0.231 / 0.153 / 0.069 ms at q|k|v / gate|up / o against 0.256 / 0.218 / 0.079
    # for 64 and 2 (the same run; fp32 partials of 13 MiB at q|k|v)
    t_block_m: int = 64
    t_block_n: int = 128
    t_programs_per_sm: int = 4
    num_warps: int = 4  # 8 was 2-24% slower in every product (the same run)


TUNING = DropoutMatmulTuning()


@triton.jit
def _pick(i: tl.constexpr, v0, v1, v2, v3):
    """v_i, for a compile-time i."""
    v = v0
    if i == 1:
        v = v1
    if i == 2:
        v = v2
    if i == 3:
        v = v3
    return v


@triton.jit
def _own(i: tl.constexpr, r, S0, S1, S2, S3, S4):
    """Which of the indices r (rows of A_cat, columns of d_cat) are adapter i's."""
    return (r >= _pick(i, S0, S1, S2, S3)) & (r < _pick(i, S1, S2, S3, S4))


@triton.jit
def _drop(t, i: tl.constexpr, SEEDS, rows, col0, n_cols, T0, T1, T2, T3, C0, C1, C2, C3, DROPS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adapter i's dropout of the tile t (``rows`` × columns col0 + [0, BLOCK_N)), in fp32: t · scale where kept,
    else 0 (t itself where the adapter has no dropout: bit i of DROPS clear)."""
    t = t.to(tl.float32)
    if (DROPS >> i) & 1:
        keep = keep_mask(tl.load(SEEDS + i), rows, col0, n_cols, _pick(i, T0, T1, T2, T3), BLOCK_M, BLOCK_N)
        t = tl.where(keep, t * _pick(i, C0, C1, C2, C3), 0.0)
    return t


@triton.jit
def _dropped_matmul_kernel(X, A, XA, SEEDS, n_rows, n_cols, r_total, stride_x, stride_a, stride_xa,
                           S0, S1, S2, S3, S4, T0, T1, T2, T3, C0, C1, C2, C3,
                           N_ADAPTERS: tl.constexpr, DROPS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """XA[rows, S_i:S_{i+1}] = drop_i(X[rows]) · A[S_i:S_{i+1}]ᵀ for each adapter i (bit i of DROPS: it drops)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    r = tl.arange(0, R_PAD)
    in_rows = rows < n_rows
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_cols = cols < n_cols
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                    other=0.0)
        a = tl.load(A + r[:, None] * stride_a + cols[None, :], mask=(r < r_total)[:, None] & in_cols[None, :],
                    other=0.0)
        for i in tl.static_range(N_ADAPTERS):
            x_i = _drop(x, i, SEEDS, rows, k0, n_cols, T0, T1, T2, T3, C0, C1, C2, C3, DROPS, BLOCK_M, BLOCK_K)
            a_i = tl.where(_own(i, r, S0, S1, S2, S3, S4)[:, None], a, 0.0)
            acc += dot(x_i.to(x.dtype), tl.trans(a_i), IEEE, UPCAST)
    tl.store(XA + rows[:, None] * stride_xa + r[None, :], acc.to(XA.dtype.element_ty),
             mask=in_rows[:, None] & (r < r_total)[None, :])


@triton.jit
def _dropped_matmul_add_kernel(D, A, OUT, SEEDS, n_rows, n_cols, r_total, stride_d, stride_a, stride_out,
                               S0, S1, S2, S3, S4, T0, T1, T2, T3, C0, C1, C2, C3,
                               N_ADAPTERS: tl.constexpr, DROPS: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """OUT[rows, cols] += Σ_i drop_i(D[rows, S_i:S_{i+1}] · A[S_i:S_{i+1}, cols]), summed in fp32, rounded once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    r = tl.arange(0, R_PAD)
    in_rows, in_cols, in_r = rows < n_rows, cols < n_cols, r < r_total
    d = tl.load(D + rows[:, None] * stride_d + r[None, :], mask=in_rows[:, None] & in_r[None, :], other=0.0)
    a = tl.load(A + r[:, None] * stride_a + cols[None, :], mask=in_r[:, None] & in_cols[None, :], other=0.0)
    inside = in_rows[:, None] & in_cols[None, :]
    out_at = OUT + rows[:, None] * stride_out + cols[None, :]
    acc = tl.load(out_at, mask=inside, other=0.0).to(tl.float32)
    for i in tl.static_range(N_ADAPTERS):
        product = dot(tl.where(_own(i, r, S0, S1, S2, S3, S4)[None, :], d, 0.0), a, IEEE, UPCAST)
        acc += _drop(product, i, SEEDS, rows, col0, n_cols, T0, T1, T2, T3, C0, C1, C2, C3, DROPS, BLOCK_M, BLOCK_N)
    tl.store(out_at, acc.to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _dropped_matmul_t_kernel(D, X, PART, SEEDS, n_rows, n_cols, r_total, rows_per_split, stride_d, stride_x,
                             S0, S1, S2, S3, S4, T0, T1, T2, T3, C0, C1, C2, C3,
                             N_ADAPTERS: tl.constexpr, DROPS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """PART[split, S_i:S_{i+1}, cols] = D[tokens, S_i:S_{i+1}]ᵀ · drop_i(X[tokens, cols]) over this split's tokens."""
    col0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    cols = col0 + tl.arange(0, BLOCK_N)
    r = tl.arange(0, R_PAD)
    in_cols, in_r = cols < n_cols, r < r_total
    start = split.to(tl.int64) * rows_per_split
    end = tl.minimum(start + rows_per_split, n_rows)
    acc = tl.zeros((R_PAD, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        in_rows = rows < end
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=in_rows[:, None] & in_cols[None, :],
                    other=0.0)
        d_t = tl.load(D + rows[None, :] * stride_d + r[:, None], mask=in_r[:, None] & in_rows[None, :], other=0.0)
        for i in tl.static_range(N_ADAPTERS):
            x_i = _drop(x, i, SEEDS, rows, col0, n_cols, T0, T1, T2, T3, C0, C1, C2, C3, DROPS, BLOCK_M, BLOCK_N)
            acc += dot(tl.where(_own(i, r, S0, S1, S2, S3, S4)[:, None], d_t, 0.0), x_i.to(x.dtype), IEEE, UPCAST)
    part = PART + split.to(tl.int64) * r_total * n_cols
    tl.store(part + r[:, None] * n_cols + cols[None, :], acc, mask=in_r[:, None] & in_cols[None, :])


# ---- launchers ------------------------------------------------------------------------------------------------------

def _launch_groups(ranks: list[int]) -> list[list[int]]:
    """The adapters of each launch: consecutive, at most MAX_ADAPTERS, and their ranks summing to at most
    MAX_LAUNCH_RANK unless one adapter alone is larger (the tiles' rank dimension stays in registers)."""
    groups: list[list[int]] = []
    for i, r in enumerate(ranks):
        last = groups[-1] if groups else None
        if last is None or len(last) == MAX_ADAPTERS or sum(ranks[j] for j in last) + r > MAX_LAUNCH_RANK:
            groups.append([i])
        else:
            last.append(i)
    return groups


def _parts(ranks: list[int], draws: GroupDraws):
    """The launches of a group: (first adapter, row range in A_cat, the kernel's scalar arguments S0-S4 (rank bounds),
    T0-T3 (keep thresholds) and C0-C3 (scales), and the constexprs every kernel takes from the adapters: N_ADAPTERS,
    DROPS, R_PAD)."""
    bounds = [0]
    for r in ranks:
        bounds.append(bounds[-1] + r)
    for idx in _launch_groups(ranks):
        lo, hi = bounds[idx[0]], bounds[idx[-1] + 1]
        segments = [bounds[i] - lo for i in idx] + [hi - lo]
        segments += [segments[-1]] * (MAX_ADAPTERS + 1 - len(segments))
        rates = [draws.rates[i] for i in idx] + [0.0] * (MAX_ADAPTERS - len(idx))
        thresholds, scales = zip(*map(rate_args, rates))
        drops = sum(1 << j for j, p in enumerate(rates) if p > 0)
        yield idx[0], (lo, hi), [*segments, *thresholds, *scales], dict(N_ADAPTERS=len(idx), DROPS=drops,
                                                                   R_PAD=max(16, pow2(hi - lo)))


def _check(name: str, draws: GroupDraws, ranks: list[int], *tensors: torch.Tensor) -> None:
    if len(draws) != len(ranks):
        raise ValueError(f"{name}: {len(draws)} dropout draws for {len(ranks)} adapters")
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name} takes 2-D tensors with unit column stride, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def dropped_matmul(x: torch.Tensor, a_cat: torch.Tensor, ranks: list[int], draws: GroupDraws) -> torch.Tensor:
    """[N, Σr] in x's dtype: column block i is drop_i(x) · A_iᵀ (A_cat [Σr, in] in x's dtype)."""
    if not draws.seeded:
        return dropped_matmul_reference(x, a_cat, ranks, draws)
    _check("dropped_matmul", draws, ranks, x, a_cat)
    n, k = x.shape
    xa = torch.empty((n, a_cat.shape[0]), dtype=x.dtype, device=x.device)
    for first, (lo, hi), scalars, meta in _parts(ranks, draws) if n else ():
        launch(_dropped_matmul_kernel, (cdiv(n, TUNING.forward_block_m),),
               [x, a_cat[lo:], xa[:, lo:], draws.seeds[first:], n, k, hi - lo, x.stride(0), a_cat.stride(0),
                xa.stride(0), *scalars],
               dict(meta, BLOCK_M=TUNING.forward_block_m, BLOCK_K=TUNING.forward_block_k, **dot_flags(x.dtype),
                    num_warps=TUNING.num_warps))
    return xa


def dropped_matmul_add(out: torch.Tensor, d_cat: torch.Tensor, a_cat: torch.Tensor, ranks: list[int],
                       draws: GroupDraws) -> torch.Tensor:
    """out += Σ_i drop_i(d_i · A_i), d_cat [N, Σr] and A_cat [Σr, in] in out's dtype; returns out."""
    if not draws.seeded:
        return dropped_matmul_add_reference(out, d_cat, a_cat, ranks, draws)
    _check("dropped_matmul_add", draws, ranks, out, d_cat, a_cat)
    n, k = out.shape
    for first, (lo, hi), scalars, meta in _parts(ranks, draws) if n and k else ():
        launch(_dropped_matmul_add_kernel, (cdiv(n, TUNING.add_block_m), cdiv(k, TUNING.add_block_n)),
               [d_cat[:, lo:], a_cat[lo:], out, draws.seeds[first:], n, k, hi - lo, d_cat.stride(0),
                a_cat.stride(0), out.stride(0), *scalars],
               dict(meta, BLOCK_M=TUNING.add_block_m, BLOCK_N=TUNING.add_block_n, **dot_flags(out.dtype),
                    num_warps=TUNING.num_warps))
    return out


def dropped_matmul_t(d_cat: torch.Tensor, x: torch.Tensor, ranks: list[int], draws: GroupDraws) -> torch.Tensor:
    """[Σr, in] fp32: row block i is d_iᵀ · drop_i(x) (d_cat [N, Σr] in x's dtype)."""
    if not draws.seeded:
        return dropped_matmul_t_reference(d_cat, x, ranks, draws)
    _check("dropped_matmul_t", draws, ranks, d_cat, x)
    n, k = x.shape
    out = torch.empty((d_cat.shape[1], k), dtype=torch.float32, device=x.device)
    if not n:
        return out.zero_()
    col_blocks = cdiv(k, TUNING.t_block_n)
    splits = max(1, min(cdiv(n, TUNING.t_block_m), cdiv(TUNING.t_programs_per_sm * sm_count(x.device), col_blocks)))
    rows_per_split = cdiv(cdiv(n, splits), TUNING.t_block_m) * TUNING.t_block_m
    splits = cdiv(n, rows_per_split)
    for first, (lo, hi), scalars, meta in _parts(ranks, draws):
        part = out[lo:hi] if splits == 1 else torch.empty((splits, hi - lo, k), dtype=torch.float32,
                                                          device=x.device)
        launch(_dropped_matmul_t_kernel, (col_blocks, splits),
               [d_cat[:, lo:], x, part, draws.seeds[first:], n, k, hi - lo, rows_per_split, d_cat.stride(0),
                x.stride(0), *scalars],
               dict(meta, BLOCK_M=TUNING.t_block_m, BLOCK_N=TUNING.t_block_n, **dot_flags(x.dtype),
                    num_warps=TUNING.num_warps))
        if splits > 1:
            torch.sum(part, dim=0, out=out[lo:hi])
    return out


# ---- PyTorch references: one adapter at a time, each draw's mask applied to the whole tensor ------------------------

def _dropped(t: torch.Tensor, draw) -> torch.Tensor:
    return t if draw is None else draw.apply(t)


def dropped_matmul_reference(x: torch.Tensor, a_cat: torch.Tensor, ranks: list[int], draws) -> torch.Tensor:
    return torch.cat([_dropped(x, draw) @ a.t() for a, draw in zip(a_cat.split(ranks), draws)], dim=1)


def dropped_matmul_add_reference(out: torch.Tensor, d_cat: torch.Tensor, a_cat: torch.Tensor, ranks: list[int],
                                 draws) -> torch.Tensor:
    for d, a, draw in zip(d_cat.split(ranks, dim=1), a_cat.split(ranks), draws):
        if draw is None:
            out.addmm_(d, a)
        else:
            draw.apply(d @ a, out=out, accumulate=True)
    return out


def dropped_matmul_t_reference(d_cat: torch.Tensor, x: torch.Tensor, ranks: list[int], draws) -> torch.Tensor:
    return torch.cat([(d.t() @ _dropped(x, draw)).float() for d, draw in zip(d_cat.split(ranks, dim=1), draws)])
