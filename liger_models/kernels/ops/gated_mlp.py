"""Gated MLP activation: out = act(gate) * up (SwiGLU with act = SiLU, GeGLU with act = GELU).

Math, with x = gate and u = up, all in fp32 and rounded once to the activation dtype:
  silu       a(x) = x·σ(x),                               a'(x) = σ(x)·(1 + x·(1 − σ(x)))
  gelu_tanh  a(x) = 0.5·x·(1 + tanh z) = x·σ(2z),         z = √(2/π)·(x + 0.044715·x³)
             a'(x) = σ(2z) + 2x·σ(2z)·(1 − σ(2z))·√(2/π)·(1 + 3·0.044715·x²)
  gelu       a(x) = x·Φ(x) = 0.5·x·(1 + erf(x/√2)),        a'(x) = Φ(x) + x·φ(x)     (exact, erf)
  out = a(x)·u;   d gate = dout·u·a'(x);   d up = dout·a(x)

Exact GELU without erf: Φ(x) = 1 − Q(x) for x ≥ 0 and Q(|x|) for x < 0, with the normal tail
Q(z) = φ(z)·R(z) and R the Mills ratio, R(z) = t·P(s), t = 1/(1 + z/4), s = 1 − t = (z/4)·t, P a degree-9
polynomial (fp32 minimax fit of R/t, relative error 3e-8). One exp(−x²/2) serves Q and φ, 1/(1 + z/4) is one
rsqrt, and the lower tail keeps its relative precision (0.5·(1 + erf) cancels there). In fp32: |Φ error| ≤
1.2e-7 (≈ 2 ulp at 0.5), relative error ≤ 1e-5 for −12 < x < −3. It costs about what the tanh form does: with
libdevice's erf plus a separate exp the kernels were ALU-bound (H200, 16384×16384 bf16 packed fwd + bwd: 1.21
ms); now 1.01 ms, the copy-bandwidth floor.

HF numerics: `down(act(gate) * up)` runs the activation in the activation dtype (rounded once) and the
product in that dtype (rounded again). Here both happen in fp32 with a single rounding, so bf16 results sit
closer to the float64 reference than HF's own.

Memory: the backward recomputes a(x) from the two saved inputs (nothing else is saved). When the inputs'
memory belongs to an autograd intermediate (the gate/up projection output), the backward writes d gate and
d up over it, as Liger does, so fwd + bwd allocates only the output. Their version counter is bumped, so any
other user that saved the same tensor for its own backward fails loudly instead of reading gradients. A leaf,
a view of a leaf, or a gate/up pair that shares elements gets fresh gradient memory instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from .._custom_ops import custom_op, refuse_double_backward
from .._dispatch import once_differentiable, row_view, use_triton
from .._launch import cdiv, launch, on_input_device, pow2

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


@dataclass(frozen=True)
class GatedTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Streaming tile: elements per program and per thread (→ num_warps); benchmarks/tools/tune_streaming.py sweeps them.
    tile: int = 2048
    elems_per_thread: int = 16
    # gated_backward_scaled in one kernel; False: its unfused form (scaled copy, gated backward, row dots in fp32
    # chunks), kept as the bisection path. The one pass over the rows takes 8% of the MoE layer's time at
    # Qwen3-30B-A3B width and 7% at Mixtral's off its forward + backward (bench_moe, 2026-12-06, H100:
    # BENCHMARKS.md "Mixture-of-experts layer")
    fuse_scaled_backward: bool = True
    # fp32 elements of one chunk of the unfused form's row dots: 64 MiB
    row_dot_elements: int = 1 << 24


TUNING = GatedTuning()


def _activation_reference(x: torch.Tensor, activation: str, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """a(x), and a'(x) with ``grad`` (else None), in x's dtype with plain autograd-aware ops (module docstring).

    The GELUs in their cancellation-free forms: 0.5·(1 + tanh z) = σ(2z) and 1 + erf(x/√2) = erfc(−x/√2). The
    textbook 1 + tanh / 1 + erf loses every digit for x ≲ −7 even in float64 (1 + tanh(−17.6) is 2e-15 next to a
    float64 spacing of 1e-16 at 1), which made this reference, not the kernel, wrong by 4% there."""
    if activation == "silu":
        s = torch.sigmoid(x) if grad else None
        return F.silu(x), (s * (1.0 + x * (1.0 - s)) if grad else None)
    if activation == "gelu_tanh":
        k = 2.0 * math.sqrt(2.0 / math.pi)
        s = torch.sigmoid(k * (x + 0.044715 * x * x * x))
        return x * s, (s + x * s * (1.0 - s) * k * (1.0 + 3 * 0.044715 * x * x) if grad else None)
    if activation == "gelu":
        cdf = 0.5 * torch.erfc(x * -math.sqrt(0.5))
        return x * cdf, (cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) if grad else None)
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")


def gated_mlp_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up in fp32 (float64 for float64 inputs), rounded once to gate's dtype; autograd-aware."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    a, _ = _activation_reference(gate.to(compute), activation, grad=False)
    return (a * up.to(compute)).to(gate.dtype)


def gated_mlp_reference_backward(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, activation: str = "silu"
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate, d up) of gated_mlp_reference in closed form, fp32 (float64 for float64 inputs), not rounded, and its
    forward output (rounded as gated_mlp_reference rounds it, bit for bit).

    No autograd: a custom op's implementation runs below the autograd dispatcher while a compiled graph runs, where
    autograd.grad has no graph to differentiate."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    u, d = up.to(compute), dout.to(compute)
    a, da = _activation_reference(gate.to(compute), activation, grad=True)
    return d * u * da, d * a, (a * u).to(gate.dtype)


@triton.jit
def _mills_poly(s):
    """P(s) of the Mills-ratio form of Φ (module docstring), 1/√(2π) folded in; Horner in fp32."""
    p = -0.01978192 * s + 0.0971604
    p = p * s - 0.16073026
    p = p * s + 0.03458553
    p = p * s + 0.15566375
    p = p * s + 0.07872724
    p = p * s - 0.79860176
    p = p * s + 1.30848129
    p = p * s - 1.09576868
    return p * s + 0.49999998


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """a(x) and a'(x) in fp32 (ACT: 0 silu, 1 gelu_tanh, 2 gelu erf); a'(x) is dead code in the forward."""
    if ACT == 0:
        s = tl.sigmoid(x)
        a = x * s
        da = s * (1.0 + x * (1.0 - s))
    elif ACT == 1:
        x2 = x * x
        # 0.5·(1 + tanh z) = σ(2z): one exp, no tanh.
        s = tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x2))
        a = x * s
        da = s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * x2)
    else:
        e = tl.exp2(x * x * -0.7213475204444817)  # exp(−x²/2), shared by Q and φ
        quarter_z = 0.25 * tl.minimum(tl.abs(x), 1.0e4)  # e is 0 long before the clamp; keeps |x| = inf finite
        y = 1.0 + quarter_z
        t = tl.rsqrt(y * y)  # 1/y in one MUFU op (y ≥ 1), where a division costs eight instructions
        s = quarter_z * t  # 1 − t, without the cancellation near x = 0
        p = _mills_poly(s)
        q = e * t * p  # Q(|x|)
        cdf = tl.where(x >= 0, 1.0 - q, q)
        a = x * cdf
        da = cdf + x * (0.3989422804014327 * e)
    return a, da


@triton.jit
def _tile(n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row (int64) and column indices of this program's tile; tiles run along each row first, so consecutive
    programs stream consecutive memory (and the 1-D grid has no 65535 limit on the row count)."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_C)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int32) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, cols


@triton.jit
def _gated_fwd_kernel(
    GATE, UP, OUT, n_rows, n_cols,
    stride_gate_row, stride_up_row, stride_out_row,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows, cols = _tile(n_cols, BLOCK_R, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(GATE + rows[:, None] * stride_gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(x, ACT)
    tl.store(OUT + rows[:, None] * stride_out_row + cols[None, :], (a * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    DOUT, GATE, UP, DGATE, DUP, PROD, n_rows, n_cols,
    stride_dout_row, stride_gate_row, stride_up_row, stride_dgate_row, stride_dup_row, stride_prod_row,
    ACT: tl.constexpr, STORE_PRODUCT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # DGATE/DUP may be GATE/UP themselves and PROD may be DOUT: every element is read before the same program
    # overwrites it.
    rows, cols = _tile(n_cols, BLOCK_R, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    dy = tl.load(DOUT + rows[:, None] * stride_dout_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(GATE + rows[:, None] * stride_gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(x, ACT)
    dtype = DGATE.dtype.element_ty
    tl.store(DGATE + rows[:, None] * stride_dgate_row + cols[None, :], (dy * u * da).to(dtype), mask=mask)
    tl.store(DUP + rows[:, None] * stride_dup_row + cols[None, :], (dy * a).to(dtype), mask=mask)
    if STORE_PRODUCT:  # the forward's output, for a following GEMM's weight gradient (same rounding as forward)
        tl.store(PROD + rows[:, None] * stride_prod_row + cols[None, :], (a * u).to(PROD.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_scaled_kernel(
    GRAD, SCALE, GATE, UP, DGATE, DUP, DOTS, n_rows, n_cols,
    stride_grad_row, stride_gate_row, stride_up_row, stride_dgate_row, stride_dup_row,
    ACT: tl.constexpr, WITH_DOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # The product is written over GRAD and DGATE/DUP may be GATE/UP: every element is read before the same program
    # overwrites it. DOTS: one fp32 partial row dot per row and column block, (n_rows, column blocks).
    rows, cols = _tile(n_cols, BLOCK_R, BLOCK_C)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    g = tl.load(GRAD + rows[:, None] * stride_grad_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SCALE + rows, mask=row_ok, other=0.0).to(tl.float32)
    x = tl.load(GATE + rows[:, None] * stride_gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = DGATE.dtype.element_ty
    dy = (g * s[:, None]).to(dtype).to(tl.float32)  # rounded once, as torch.mul into a tensor of that dtype
    a, da = _act_and_grad(x, ACT)
    tl.store(DGATE + rows[:, None] * stride_dgate_row + cols[None, :], (dy * u * da).to(dtype), mask=mask)
    tl.store(DUP + rows[:, None] * stride_dup_row + cols[None, :], (dy * a).to(dtype), mask=mask)
    product = (a * u).to(GRAD.dtype.element_ty)
    tl.store(GRAD + rows[:, None] * stride_grad_row + cols[None, :], product, mask=mask)
    if WITH_DOTS:  # exact fp32 products of the two stored (rounded) operands, summed in fp32
        col_blocks = tl.cdiv(n_cols, BLOCK_C)
        col_block = tl.program_id(0).to(tl.int64) % col_blocks
        tl.store(DOTS + rows * col_blocks + col_block, tl.sum(g * product.to(tl.float32), axis=1), mask=row_ok)


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int], int, int, int]:
    """A streaming layout: TUNING.tile elements per program (a row slice, or several short rows)."""
    block_c = min(pow2(n_cols), TUNING.tile)
    block_r = min(TUNING.tile // block_c, pow2(n_rows))
    warps = max(1, min(16, block_r * block_c // (32 * TUNING.elems_per_thread)))
    return (cdiv(n_rows, block_r) * cdiv(n_cols, block_c),), block_r, block_c, warps


@on_input_device  # a cuda:1 input must not run on the current cuda:0 (Triton launches there)
def gated_forward(gate2d: torch.Tensor, up2d: torch.Tensor, out2d: torch.Tensor, activation: str) -> None:
    """out2d = act(gate2d) · up2d for (rows, I) views with unit column stride (no autograd; used by fused layers)."""
    n_rows, n_cols = gate2d.shape
    if not use_triton(gate2d, up2d):
        out2d.copy_(gated_mlp_reference(gate2d, up2d, activation))
        return
    grid, block_r, block_c, warps = _grid(n_rows, n_cols)
    launch(_gated_fwd_kernel, grid,
           [gate2d, up2d, out2d, n_rows, n_cols, gate2d.stride(0), up2d.stride(0), out2d.stride(0)],
           dict(ACT=ACTIVATIONS[activation], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps))


@on_input_device
def gated_backward(dout2d, gate2d, up2d, dgate2d, dup2d, activation: str, product2d=None) -> None:
    """dgate2d, dup2d from dout2d, recomputing the activation; dgate2d/dup2d may alias gate2d/up2d (in place).
    With product2d, the same pass also writes the forward's act(gate2d)·up2d there (bit-identical to
    gated_forward); product2d may alias dout2d. A fused layer uses it for the next GEMM's weight gradient
    instead of re-reading gate/up in a separate forward pass."""
    n_rows, n_cols = gate2d.shape
    if not use_triton(dout2d, gate2d, up2d):
        dx, du, product = gated_mlp_reference_backward(gate2d, up2d, dout2d, activation)
        dgate2d.copy_(dx)
        dup2d.copy_(du)
        if product2d is not None:  # (product2d may alias dout2d: written last)
            product2d.copy_(product)
        return
    grid, block_r, block_c, warps = _grid(n_rows, n_cols)
    prod = dout2d if product2d is None else product2d  # unused pointer when STORE_PRODUCT is off
    launch(_gated_bwd_kernel, grid,
           [dout2d, gate2d, up2d, dgate2d, dup2d, prod, n_rows, n_cols, dout2d.stride(0), gate2d.stride(0),
            up2d.stride(0), dgate2d.stride(0), dup2d.stride(0), prod.stride(0)],
           dict(ACT=ACTIVATIONS[activation], STORE_PRODUCT=product2d is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=warps))


@on_input_device
def gated_backward_scaled(grad2d, scale, gate2d, up2d, dgate2d, dup2d, activation: str,
                          dots=None) -> torch.Tensor:
    """A routed expert's activation backward (modules/moe.py): with dout = grad2d·scale (scale (rows,) per row, the
    product rounded once to dgate2d's dtype, as ``torch.mul`` into a tensor of it would), writes dgate2d and dup2d as
    ``gated_backward`` does and, given ``dots`` (fp32 (rows,)), ⟨grad2d[r], product[r]⟩ per row from exact fp32
    products of the two (the routing weight's gradient), where product = act(gate2d)·up2d is the forward's output;
    returns the product. dgate2d/dup2d may alias gate2d/up2d.

    With TUNING.fuse_scaled_backward, one kernel pass over the rows that writes the product over grad2d; else the
    unfused form: the scaled copy, ``gated_backward`` writing the product over it, and the row dots through fp32 row
    chunks (at Mixtral's width about 24 bytes moved per element beyond the gated backward's own)."""
    n_rows, n_cols = gate2d.shape
    if gate2d.numel() == 0:  # no program to launch; an empty row's dot is 0
        if dots is not None:
            dots.zero_()
        return grad2d
    if not (use_triton(grad2d, scale, gate2d, up2d) and TUNING.fuse_scaled_backward):
        dout = torch.mul(grad2d, scale[:, None], out=torch.empty_like(grad2d, dtype=dgate2d.dtype))
        gated_backward(dout, gate2d, up2d, dgate2d, dup2d, activation, product2d=dout)
        if dots is not None:
            _row_dots(grad2d, dout, dots)
        return dout
    grid, block_r, block_c, warps = _grid(n_rows, n_cols)
    partial = None if dots is None else torch.empty(n_rows, cdiv(n_cols, block_c), dtype=torch.float32,
                                                    device=grad2d.device)
    launch(_gated_bwd_scaled_kernel, grid,
           [grad2d, scale, gate2d, up2d, dgate2d, dup2d, grad2d if partial is None else partial, n_rows, n_cols,
            grad2d.stride(0), gate2d.stride(0), up2d.stride(0), dgate2d.stride(0), dup2d.stride(0)],
           dict(ACT=ACTIVATIONS[activation], WITH_DOTS=partial is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=warps))
    if partial is not None:
        torch.sum(partial, dim=1, out=dots)
    return grad2d


def _row_dots(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = ⟨a[r], b[r]⟩ in fp32 from exact fp32 products, over row chunks of at most TUNING.row_dot_elements:
    formed in one piece, the fp32 copies and product of two (rows, I) tensors would outweigh both."""
    step = max(1, TUNING.row_dot_elements // max(1, a.shape[1]))
    for start in range(0, a.shape[0], step):
        out[start:start + step] = a[start:start + step].float().mul_(b[start:start + step]).sum(dim=-1)


def owns_memory(x: torch.Tensor, x2d: torch.Tensor, width: int) -> bool:
    """Whether the gradient may overwrite x2d: rows do not overlap, and the memory is a private copy or an
    autograd intermediate's (never a leaf's, whose .data the caller still holds)."""
    if x2d.shape[0] > 1 and x2d.stride(0) < width:
        return False
    if x2d.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return True
    base = x._base if x._base is not None else x
    return base.grad_fn is not None


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (rows, n) unit-stride views share no element (e.g. the two halves of a fused output)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    n, item = a.shape[1], a.element_size()
    lo_a, lo_b = a.data_ptr() // item, b.data_ptr() // item
    span_a, span_b = (a.shape[0] - 1) * a.stride(0) + n, (b.shape[0] - 1) * b.stride(0) + n
    if lo_a + span_a <= lo_b or lo_b + span_b <= lo_a:
        return True
    stride = a.stride(0)
    return b.stride(0) == stride and stride > 0 and n <= (lo_b - lo_a) % stride <= stride - n


class _GatedMLPFunction(torch.autograd.Function):
    """act(gate) * up over (rows, I) views; packed=True takes one (..., 2I) input and returns one gradient."""

    @staticmethod
    def forward(ctx, activation: str, packed: bool, *inputs: torch.Tensor) -> torch.Tensor:
        if packed:
            (gate_up,) = inputs
            gu2d = row_view(gate_up)
            half = gu2d.shape[1] // 2
            gate2d, up2d = gu2d[:, :half], gu2d[:, half:]
            ctx.inplace = owns_memory(gate_up, gu2d, 2 * half)
            ctx.save_for_backward(gu2d)
        else:
            gate, up = inputs
            gate2d, up2d = row_view(gate), row_view(up)
            n = gate2d.shape[1]
            ctx.inplace = owns_memory(gate, gate2d, n) and owns_memory(up, up2d, n) and _disjoint(gate2d, up2d)
            ctx.save_for_backward(gate2d, up2d)
        out2d = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
        if out2d.numel():
            gated_forward(gate2d, up2d, out2d, activation)
        ctx.activation, ctx.packed = activation, packed
        ctx.shapes = [x.shape for x in inputs]
        return out2d.view(inputs[0].shape[:-1] + (gate2d.shape[1],))

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        saved = ctx.saved_tensors
        if ctx.inplace:
            grads = saved
        else:
            grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in saved)
        if ctx.packed:
            n = saved[0].shape[1] // 2
            (gu2d,), (dgu2d,) = saved, grads
            gate2d, up2d, dgate2d, dup2d = gu2d[:, :n], gu2d[:, n:], dgu2d[:, :n], dgu2d[:, n:]
        else:
            (gate2d, up2d), (dgate2d, dup2d) = saved, grads
        if gate2d.numel():
            gated_backward(row_view(dout), gate2d, up2d, dgate2d, dup2d, ctx.activation)
        if ctx.inplace:
            increment_version(saved)
        return (None, None) + tuple(g.view(shape) for g, shape in zip(grads, ctx.shapes))


def _product(gate2d: torch.Tensor, up2d: torch.Tensor, activation: str, shape: torch.Size) -> torch.Tensor:
    """act(gate2d) · up2d in a fresh tensor of ``shape``."""
    out2d = torch.empty(gate2d.shape, dtype=gate2d.dtype, device=gate2d.device)
    if out2d.numel():
        gated_forward(gate2d, up2d, out2d, activation)
    return out2d.view(shape)


@custom_op("gated_mlp")
def _gated_mlp_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """_GatedMLPFunction's forward (separate gate and up) as a custom op (_custom_ops.py)."""
    return _product(row_view(gate), row_view(up), activation, gate.shape)


@_gated_mlp_op.register_fake
def _(gate, up, activation):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@custom_op("gated_mlp_backward")
def _gated_mlp_backward_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                           activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fresh tensors: an op may not write over its inputs, as the eager backward may."""
    gate2d, up2d = row_view(gate), row_view(up)
    dgate2d, dup2d = torch.empty_like(gate2d), torch.empty_like(up2d)
    if gate2d.numel():
        gated_backward(row_view(dout), gate2d, up2d, dgate2d, dup2d, activation)
    return dgate2d.view(gate.shape), dup2d.view(up.shape)


@_gated_mlp_backward_op.register_fake
def _(dout, gate, up, activation):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device))


@custom_op("gated_mlp_packed")
def _gated_mlp_packed_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """_GatedMLPFunction's forward on a packed (..., 2I) gate_up as a custom op."""
    gu2d = row_view(gate_up)
    half = gu2d.shape[1] // 2
    return _product(gu2d[:, :half], gu2d[:, half:], activation, (*gate_up.shape[:-1], half))


@_gated_mlp_packed_op.register_fake
def _(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@custom_op("gated_mlp_packed_backward")
def _gated_mlp_packed_backward_op(dout: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """d gate_up (..., 2I) in one fresh tensor."""
    gu2d = row_view(gate_up)
    half = gu2d.shape[1] // 2
    dgu2d = torch.empty_like(gu2d)
    if gu2d.numel():
        gated_backward(row_view(dout), gu2d[:, :half], gu2d[:, half:], dgu2d[:, :half], dgu2d[:, half:], activation)
    return dgu2d.view(gate_up.shape)


@_gated_mlp_packed_backward_op.register_fake
def _(dout, gate_up, activation):
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


def _gated_setup(ctx, inputs, output) -> None:
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _gated_mlp_backward(ctx, dout):
    refuse_double_backward("gated_mlp")
    return (*_gated_mlp_backward_op(dout, *ctx.saved_tensors, ctx.activation), None)


def _gated_mlp_packed_backward(ctx, dout):
    refuse_double_backward("gated_mlp_packed")
    return _gated_mlp_packed_backward_op(dout, *ctx.saved_tensors, ctx.activation), None


_gated_mlp_op.register_autograd(_gated_mlp_backward, setup_context=_gated_setup)
_gated_mlp_packed_op.register_autograd(_gated_mlp_packed_backward, setup_context=_gated_setup)


def _check(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("gate and up need at least one dimension (..., I)")
    if gate.dtype != up.dtype or not gate.dtype.is_floating_point:
        raise TypeError(f"gate and up must share one floating dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up are on different devices: {gate.device} and {up.device}")


def gated_mlp(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate, up of shape (..., I); strided views are read in place. Autograd-aware."""
    _check(gate, up, activation)
    if torch.compiler.is_compiling():  # the custom op, which dynamo traces (_custom_ops.py)
        return _gated_mlp_op(gate, up, activation)
    return _GatedMLPFunction.apply(activation, False, gate, up)


def gated_mlp_packed(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up where gate_up is (..., 2I) = [gate | up] along the last dim (a fused gate_up projection).

    The backward returns d(gate_up) as one (..., 2I) tensor written by one kernel (no chunk/cat copies).
    """
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be (..., 2I) with an even last dim, got {tuple(gate_up.shape)}")
    half = gate_up.shape[-1] // 2
    _check(gate_up[..., :half], gate_up[..., half:], activation)
    if torch.compiler.is_compiling():
        return _gated_mlp_packed_op(gate_up, activation)
    return _GatedMLPFunction.apply(activation, True, gate_up)
