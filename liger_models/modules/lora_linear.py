"""LoRA inside the packed projections: a frozen base (dense or NF4) plus low-rank adapters, per HF-named linear.

``LoraLinear`` replaces an ``nn.Linear`` under the same name (q_proj, …, Phi3's qkv_proj) and keeps its ``weight`` /
``bias`` Parameters (so packed q|k|v and gate|up buffers stay packed); its adapter is ``lora_A`` [r, in] and
``lora_B`` [out, r] (PEFT's shapes and key names), y = W·x + b + s·B·A·drop(x), s = alpha/r (alpha/√r rsLoRA).
With ``quant`` set the base is NF4 (kernels/ops/nf4.py) and ``weight`` is None; the weight is dequantised per call, in
forward and again in backward, and never saved.

What is fused, for a group of sibling linears (q|k|v, gate|up, or one linear):
  * the base stays one GEMM over the stacked (aliasing, when packed) weights;
  * without dropout, x·[A_1 | … | A_k]ᵀ is one thin GEMM for every adapted sibling (x is read once);
  * each adapter's B product is accumulated into its rows of the packed output by the GEMM itself (addmm with
    beta = 1): no materialised W + BA, no separate pass for the add;
  * backward: dX = dY·W + (s·dY·B)·A_cat (one GEMM plus one thin GEMM), dA_cat = (s·dY·B)ᵀ·x in one GEMM, dB per
    adapter; no base dW (the base is frozen; a base that requires grad takes the composed path instead);
  * in ``fused.py`` the same core runs behind RMSNorm (the normalised input is recomputed in backward, as for the
    base) and behind the gated activation (down_proj's adapter uses the product the activation's backward
    recomputes anyway).
Saved per group: the input (or what norm_linear already saves), x·A (N × Σr), and with dropout each adapter's mask
(N × in bytes; regenerating them from a seed is GPU work not done).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from liger_models.kernels.ops.nf4 import dequantize_nf4

from .linear import _stacked, is_plain_linear, register_group_path


class NF4Weight(nn.Module):
    """A frozen NF4 base weight: codes (uint8, two per byte) and fp32 block scales expanded at load.

    The scales are held as the bytes of an fp32 tensor (a uint8 buffer): ``model.to(torch.bfloat16)`` casts every
    floating buffer, which would round them."""

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype
        self.register_buffer("codes", codes.reshape(-1).contiguous(), persistent=False)
        self.register_buffer("absmax_bytes", absmax.to(torch.float32).contiguous().view(torch.uint8),
                             persistent=False)

    @property
    def absmax(self) -> torch.Tensor:
        return self.absmax_bytes.view(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.codes, self.absmax, self.shape, dtype or self.dtype)


class LoraLinear(nn.Module):
    """A linear with a frozen base and at most one LoRA adapter (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter | None,
                 bias: nn.Parameter | None, quant: NF4Weight | None = None) -> None:
        super().__init__()
        if (weight is None) == (quant is None):
            raise ValueError("a LoraLinear has either a dense weight or an NF4 one")
        self.in_features, self.out_features = in_features, out_features
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.quant = quant
        self.lora_A: nn.Linear | None = None
        self.lora_B: nn.Linear | None = None
        self.r, self.lora_alpha, self.scaling, self.lora_dropout = 0, 0.0, 0.0, 0.0
        self.merged = False

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "LoraLinear":
        if isinstance(linear, LoraLinear):
            return linear
        if not is_plain_linear(linear):
            raise TypeError(f"LoRA attaches to nn.Linear projections, got {type(linear).__name__}")
        return cls(linear.in_features, linear.out_features, linear.weight, linear.bias)

    @property
    def has_adapter(self) -> bool:
        return self.lora_A is not None and not self.merged

    def add_adapter(self, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                    init: str | bool = True, dtype: torch.dtype = torch.float32) -> None:
        """A [r, in] kaiming-uniform (a = √5, PEFT's default) or N(0, 1/r) ("gaussian"), B = 0; init=False draws
        B too (a non-zero adapter, for tests)."""
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {r!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}")
        device = self.quant.codes.device if self.quant is not None else self.weight.device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            if init == "gaussian":
                nn.init.normal_(self.lora_A.weight, std=1 / r)
            else:
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            if init is False:
                nn.init.normal_(self.lora_B.weight, std=1 / math.sqrt(r))
            else:
                nn.init.zeros_(self.lora_B.weight)
        self.r, self.lora_alpha, self.lora_dropout = r, float(alpha), float(dropout)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.dequantize(dtype)
        return self.weight if dtype is None else self.weight.to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """s·B·A in fp32."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    @torch.no_grad()
    def merge(self) -> None:
        """W += s·B·A (computed in fp32, rounded once); the adapter then adds nothing until ``unmerge``."""
        if self.quant is not None:
            raise ValueError("merging into NF4 weights would re-quantise them; export a merged checkpoint instead "
                             "(liger_models.lora.save_merged)")
        if self.lora_A is not None and not self.merged:
            self.weight.copy_(self.weight.float() + self.delta_weight())
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W −= s·B·A: exact up to one rounding of W in its dtype."""
        if self.merged:
            self.weight.copy_(self.weight.float() - self.delta_weight())
            self.merged = False

    def extra_repr(self) -> str:
        base = "nf4" if self.quant is not None else "dense"
        return (f"in_features={self.in_features}, out_features={self.out_features}, base={base}, r={self.r}, "
                f"scaling={self.scaling:g}, dropout={self.lora_dropout:g}{', merged' if self.merged else ''}")

    def composed(self, x: torch.Tensor) -> torch.Tensor:
        """The same output from plain ops (autocast, torch.compile, a trainable base): the reference path."""
        y = F.linear(x, self.base_weight(x.dtype if self.quant is not None else None), self.bias)
        if not self.has_adapter:
            return y
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return y + self.lora_B(self.lora_A(h.to(self.lora_A.weight.dtype))).to(y.dtype) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_packed_linear(x, [self])


# ---- groups of sibling linears ------------------------------------------------------------------------------------

def is_lora_group(linears: list[nn.Module]) -> bool:
    """Some of ``linears`` are LoraLinear and the rest plain nn.Linear: the LoRA paths apply."""
    return (any(isinstance(lin, LoraLinear) for lin in linears)
            and all(isinstance(lin, LoraLinear) or is_plain_linear(lin) for lin in linears))


def frozen_bases(linears: list[nn.Module]) -> bool:
    """No base weight or bias needs a gradient (the fused LoRA core computes none)."""
    for lin in linears:
        for p in (getattr(lin, "weight", None), getattr(lin, "bias", None)):
            if p is not None and p.requires_grad:
                return False
    return True


class Group:
    """What the fused core needs of a group of siblings: output rows, the stacked base, the adapters."""

    def __init__(self, linears: list[nn.Module]) -> None:
        self.linears = linears
        self.rows, start = [], 0
        for lin in linears:
            self.rows.append((start, start + lin.out_features))
            start += lin.out_features
        self.adapted = [i for i, lin in enumerate(linears) if isinstance(lin, LoraLinear) and lin.has_adapter]
        self.scales = [linears[i].scaling for i in self.adapted]
        self.ranks = [linears[i].r for i in self.adapted]
        self.dropouts = [linears[i].lora_dropout if linears[i].training else 0.0 for i in self.adapted]
        self.any_dropout = any(p > 0 for p in self.dropouts)
        self.has_bias = linears[0].bias is not None

    def adapter_params(self) -> list[torch.Tensor]:
        """A_1 … A_k, B_1 … B_k: the Function's differentiable inputs."""
        lins = [self.linears[i] for i in self.adapted]
        return [lin.lora_A.weight for lin in lins] + [lin.lora_B.weight for lin in lins]

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        ws = [lin.base_weight(dtype) if isinstance(lin, LoraLinear) and lin.quant is not None else lin.weight
              for lin in self.linears]
        return _stacked(ws)

    def bias(self) -> torch.Tensor | None:
        return _stacked([lin.bias for lin in self.linears]) if self.has_bias else None


def core_forward(x2: torch.Tensor, group: Group, params: list[torch.Tensor], out2d: torch.Tensor):
    """out2d := x2·Wᵀ + b + Σ s_i·(drop_i(x2)·A_iᵀ)·B_iᵀ into each adapter's rows; returns (xa, masks)."""
    w, b = group.weight(x2.dtype), group.bias()
    if b is None:
        torch.mm(x2, w.t(), out=out2d)
    else:
        torch.addmm(b, x2, w.t(), out=out2d)
    k = len(group.adapted)
    if not k:
        return None, []
    As = [a.to(x2.dtype) for a in params[:k]]
    Bs = [bm.to(x2.dtype) for bm in params[k:]]
    masks: list[torch.Tensor | None] = []
    if not group.any_dropout:
        xa = x2 @ torch.cat(As).t()  # one thin GEMM for every adapter
        parts = xa.split(group.ranks, dim=1)
    else:
        parts = []
        for a, p in zip(As, group.dropouts):
            if p > 0:
                mask = torch.empty_like(x2, dtype=torch.bool).bernoulli_(1 - p)
                masks.append(mask)
                parts.append((x2 * mask) @ a.t() * (1 / (1 - p)))
            else:
                masks.append(None)
                parts.append(x2 @ a.t())
        xa = torch.cat(parts, dim=1)
    for i, part, bm, s in zip(group.adapted, parts, Bs, group.scales):
        lo, hi = group.rows[i]
        out2d[:, lo:hi].addmm_(part, bm.t(), alpha=s)  # the GEMM adds into the packed output
    return xa, masks


def core_backward_input(g: torch.Tensor, group: Group, params: list[torch.Tensor], xa: torch.Tensor | None,
                        masks: list, need_dx: bool):
    """(dx or None, s·dY_i·B_i per adapter, dB per adapter). dx includes the adapters' path."""
    k = len(group.adapted)
    w = group.weight(g.dtype) if need_dx else None
    dx = g @ w if need_dx else None
    if not k:
        return dx, [], []
    As = [a.to(g.dtype) for a in params[:k]]
    Bs = [bm.to(g.dtype) for bm in params[k:]]
    dxs, dBs = [], []
    xa_parts = xa.split(group.ranks, dim=1)
    for i, bm, s, part, bparam in zip(group.adapted, Bs, group.scales, xa_parts, params[k:]):
        lo, hi = group.rows[i]
        gi = g[:, lo:hi]
        dxs.append((gi @ bm) * s)
        dBs.append(((gi.t() @ part) * s).to(bparam.dtype))
    if need_dx:
        if not group.any_dropout:
            dx.addmm_(torch.cat(dxs, dim=1), torch.cat(As))
        else:
            for d, a, mask, p in zip(dxs, As, masks, group.dropouts):
                term = d @ a
                dx.add_(term if mask is None else term * mask * (1 / (1 - p)))
    return dx, dxs, dBs


def core_backward_A(dxs: list[torch.Tensor], x2: torch.Tensor, group: Group, params: list[torch.Tensor],
                    masks: list) -> list[torch.Tensor]:
    """dA per adapter: (s·dY_i·B_i)ᵀ·drop_i(x), one GEMM for all without dropout."""
    k = len(group.adapted)
    if not k:
        return []
    if not group.any_dropout:
        dA = torch.cat(dxs, dim=1).t() @ x2
        return [d.to(a.dtype) for d, a in zip(dA.split(group.ranks), params[:k])]
    out = []
    for d, mask, p, a in zip(dxs, masks, group.dropouts, params[:k]):
        xi = x2 if mask is None else x2 * mask * (1 / (1 - p))
        out.append((d.t() @ xi).to(a.dtype))
    return out


class _LoraPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, *params):
        x2 = x.reshape(-1, x.shape[-1])
        out = x.new_empty((*x.shape[:-1], group.rows[-1][1]))
        xa, masks = core_forward(x2, group, list(params), out.view(-1, out.shape[-1]))
        ctx.group, ctx.masks, ctx.x_shape = group, masks, x.shape
        ctx.save_for_backward(x2, xa, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, *params = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        dx, dxs, dBs = core_backward_input(g, ctx.group, params, xa, ctx.masks, ctx.needs_input_grad[0])
        dAs = core_backward_A(dxs, x2, ctx.group, params, ctx.masks)
        return (None if dx is None else dx.view(ctx.x_shape), None, *dAs, *dBs)


def lora_packed_linear(x: torch.Tensor, linears: list[nn.Module]) -> torch.Tensor:
    """``cat([lin(x) for lin in linears], -1)`` for a LoRA group, base and adapters fused as described above."""
    if (torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling() or not frozen_bases(linears)):
        return torch.cat([lin.composed(x) if isinstance(lin, LoraLinear) else lin(x) for lin in linears], dim=-1)
    group = Group(linears)
    return _LoraPacked.apply(x, group, *group.adapter_params())


register_group_path(is_lora_group, lora_packed_linear)
