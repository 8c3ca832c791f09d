"""LoRA inside the packed projections: a frozen base (dense or NF4) plus low-rank adapters, per HF-named linear.

``LoraLinear`` replaces an ``nn.Linear`` under the same name (q_proj, …, Phi3's qkv_proj) and keeps its ``weight`` /
``bias`` Parameters (so packed q|k|v and gate|up buffers stay packed); its adapter is ``lora_A`` [r, in] and
``lora_B`` [out, r] (PEFT's shapes and key names), y = W·x + b + s·B·A·drop(x), s = alpha/r (alpha/√r rsLoRA).
With ``quant`` set the base is NF4 (kernels/ops/nf4.py) and ``weight`` is None; the weight is dequantised per call, in
forward and again in backward, and never saved. A forward of at most ``nf4_matmul.TUNING.max_rows`` rows (a decoding
step; 1 by default, where that kernel was measured faster) instead multiplies each NF4 sibling with its codes decoded
inside the K-loop (kernels/ops/nf4_matmul.py), into its rows of the output.

What is fused, for a group of sibling linears (q|k|v, gate|up, or one linear):
  * the base stays one GEMM over the stacked (aliasing, when packed) weights;
  * x·[A_1 | … | A_k]ᵀ is one thin product for every adapted sibling (x is read once): a GEMM (on the CPU one per
    adapter, as PEFT's: core_forward says why), or with dropout a kernel that draws each adapter's mask on the tiles
    of x it holds;
  * each adapter's B product is accumulated into its rows of the packed output by the GEMM itself (addmm with
    beta = 1): no materialised W + BA, no separate pass for the add;
  * backward: dX = dY·W + (s·dY·B)·A_cat (one GEMM plus one thin GEMM), dA_cat = (s·dY·B)ᵀ·x in one GEMM, dB per
    adapter; no base dW (the base is frozen; a base that requires grad takes the composed path instead);
  * in ``fused.py`` the same core runs behind RMSNorm (the normalised input is recomputed in backward, as for the
    base) and behind the gated activation (down_proj's adapter uses the product the activation's backward
    recomputes anyway).
Saved per group: the input (or what norm_linear already saves), x·A (N × Σr), and with dropout each adapter's seed:
its mask is drawn from it inside the three products that use it (drop(x)·Aᵀ, dX's drop(d·A), dA's dᵀ·drop(x):
kernels/ops/dropout_matmul.py), never formed, where a stored one would take N × in bytes per adapter (the PyTorch
reference path stores it).

DoRA (``use_dora``, PEFT's definition): an adapter also has a magnitude m (``lora_magnitude_vector``, one per output
row, initialised to the row norms of W + s·B·A), and its rows are y = b + (m / n) ⊙ (W·x + s·B·A·x) with
n = ‖W + s·B·A‖ per row held constant (no gradient through n: the DoRA paper's §4.3, as PEFT does). n is computed in
fp32 from W + s·B·A formed one block of rows at a time (never the whole matrix; B·A per block is a thin GEMM);
in the fused core the output rows are scaled in place; backward scales dY's rows by m / n before the
LoRA backward, and dm = Σ_tokens dY ⊙ (W·x + s·B·A·x) / n recomputes W·x for the adapted rows in row blocks of
tokens (one more GEMM over those rows, where saving the output would cost its size in memory and break the in-place
RoPE that rotates q|k|v). With dropout active DoRA needs W·drop(x) as well, and the group takes ``composed``.

lm_head may carry trainable-token rows instead of an adapter (PEFT's trainable_token_indices; modules/token_rows.py):
its own ``token_adapter``, or on a tied model the embedding's (one parameter, as PEFT ties the two; held here
without registering it, so it has one name). Its output's chosen columns are then the rows' products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from liger_models.kernels.ops.dropout import GroupDraws, draws_for
from liger_models.kernels.ops.dropout_matmul import dropped_matmul, dropped_matmul_add, dropped_matmul_t
from liger_models.kernels.ops.nf4 import dequantize_nf4
from liger_models.kernels.ops.nf4_matmul import nf4_matmul, rows_fit, rows_limit

from .linear import _stacked, is_plain_linear, register_group_path
from .token_rows import TokenRows


def check_rank(r) -> None:
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {r!r}")


class NF4Weight(nn.Module):
    """A frozen NF4 base weight: codes (uint8, two per byte) and fp32 block scales expanded at load.

    Both are frozen uint8 Parameters, the scales as the bytes of their fp32 tensor (``absmax`` views them back):
      * Parameters, so FSDP2's ``fully_shard`` shards them with their layer (dim 0 of the flat bytes) and all-gathers
        the whole before the layer's forward and backward, where they are dequantised; buffers it would replicate on
        every rank. A unit that mixes them with float parameters is gathered as bytes (FSDP2 does so for mixed
        dtypes), and only trainable parameters need one dtype;
      * uint8, so ``model.to(torch.bfloat16)`` (which casts floating tensors only) cannot round the scales, and
        nothing can give them a gradient or optimizer state (an integer tensor cannot require grad);
      * outside ``state_dict`` and ``load_state_dict`` (as non-persistent buffers are): the quantised base is
        rebuilt from the dense checkpoint (``quantize_base_``) or read under bitsandbytes' keys (lora/qlora.py), so
        a model's state dict, its merged export and an adapter checkpoint never carry it."""

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.shape, self.dtype = tuple(shape), dtype
        self.codes = nn.Parameter(codes.reshape(-1).contiguous(), requires_grad=False)
        self.absmax_bytes = nn.Parameter(absmax.to(torch.float32).contiguous().view(torch.uint8),
                                         requires_grad=False)

    @property
    def absmax(self) -> torch.Tensor:
        return self.absmax_bytes.view(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.codes, self.absmax, self.shape, dtype or self.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # see the class docstring

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


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
        self.lora_magnitude_vector: nn.Parameter | None = None  # DoRA's m; PEFT's key name
        self.r, self.lora_alpha, self.scaling, self.lora_dropout = 0, 0.0, 0.0, 0.0
        self.token_adapter: TokenRows | None = None
        self.merged = False

    @property
    def lora_dropout(self) -> float:
        """The adapter input's dropout rate. An ``nn.Dropout`` child (``dropout``, absent at rate 0) holds it, so a
        tool that switches dropout off by setting every ``nn.Dropout``'s ``p`` to 0 (TRL's ``disable_dropout``, on by
        default in its preference trainers) switches this one off too, as it does PEFT's; a plain float here was
        left on, silently."""
        dropout = self._modules.get("dropout")
        return dropout.p if dropout is not None else 0.0

    @lora_dropout.setter
    def lora_dropout(self, rate: float) -> None:
        self._modules["dropout"] = nn.Dropout(float(rate)) if rate else None

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

    @property
    def carries_adapter(self) -> bool:
        """An adapter or its own trainable-token rows are attached, merged into the weight or not."""
        return self.lora_A is not None or self.token_adapter is not None

    @property
    def token_rows(self) -> TokenRows | None:
        """The trainable-token rows this output takes: its own, or the tied embedding's."""
        return self.token_adapter if self.token_adapter is not None else self.__dict__.get("_tied_token_rows")

    def add_token_rows(self, ids: list[int], dtype: torch.dtype = torch.float32, init: bool | str = True,
                       tied: TokenRows | None = None) -> None:
        """Trainable rows for output tokens ``ids`` (lm_head's), starting at their current values; ``tied``: the
        tied embedding's rows instead, which this head reads and does not own."""
        if self.lora_A is not None or self.quant is not None or self.bias is not None:
            raise ValueError("trainable-token rows go on a bias-free dense lm_head without a LoRA adapter")
        if tied is not None:
            self.__dict__["_tied_token_rows"] = tied
        else:
            self.token_adapter = TokenRows(self.weight, ids, None, dtype, init)

    @property
    def replaces_columns(self) -> bool:
        rows = self.token_rows
        return rows is not None and not rows.merged

    def add_adapter(self, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                    init: str | bool = True, dtype: torch.dtype = torch.float32, use_dora: bool = False) -> None:
        """A [r, in] kaiming-uniform (a = √5, PEFT's default) or N(0, 1/r) ("gaussian"), B = 0; init=False draws
        B too (a non-zero adapter, for tests). With ``use_dora`` the magnitude starts at the row norms of
        W + s·B·A (of the dequantised W for an NF4 base), so the adapted layer starts equal to W + s·B·A."""
        check_rank(r)
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
        self.lora_magnitude_vector = None
        if use_dora:
            self.lora_magnitude_vector = nn.Parameter(self.dora_norms().to(dtype))

    @property
    def use_dora(self) -> bool:
        return self.lora_magnitude_vector is not None

    def dora_norms(self) -> torch.Tensor:
        """n, the row norms of the unmerged W + s·B·A (fp32, no gradient)."""
        return dora_row_norms(self.base_weight(), self.lora_A.weight, self.lora_B.weight, self.scaling)

    def dora_factor(self) -> torch.Tensor:
        """m / n per output row (fp32); a gradient reaches m only."""
        return self.lora_magnitude_vector.float() / self.dora_norms()

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.dequantize(dtype)
        return self.weight if dtype is None else self.weight.to(dtype)

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """Key suffix → Parameter of what the adapter trains, under PEFT's names."""
        if self.lora_A is None:
            return {} if self.token_adapter is None else self.token_adapter.adapter_tensors()
        tensors = {"lora_A.weight": self.lora_A.weight, "lora_B.weight": self.lora_B.weight}
        if self.use_dora:
            tensors["lora_magnitude_vector"] = self.lora_magnitude_vector
        return tensors

    def delta_weight(self) -> torch.Tensor:
        """s·B·A in fp32."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def adapted_weight(self, factor: torch.Tensor | None = None) -> torch.Tensor:
        """W + s·B·A in fp32, times m / n per row under DoRA (``factor``: m / n when the caller has it already);
        differentiable in the adapter where grad is enabled."""
        w = self.base_weight(torch.float32) + self.delta_weight()
        if not self.use_dora:
            return w
        return w * (self.dora_factor() if factor is None else factor)[:, None]

    @torch.no_grad()
    def merged_weight(self, factor: torch.Tensor | None = None) -> torch.Tensor:
        """The weight that computes base + adapter in one GEMM, fp32: ``adapted_weight``, or W with its own trained
        token rows."""
        if self.lora_A is None:
            return self.token_adapter.applied_to(self.base_weight(torch.float32))
        return self.adapted_weight(factor)

    def projection_weight(self) -> torch.Tensor:
        """The weight whose plain product F.linear(x, weight, bias) is this layer's output, formed with autograd so
        a gradient reaches the adapter: W + s·B·A (fp32, rounded once to W's dtype, as ``merge`` rounds it), times
        m / n per row under DoRA, or W with the trained token rows. For callers that project through the head's weight
        themselves (TRL's fused LM head, see ``LigerForCausalLM.base_model``); costs one weight-sized tensor. An
        active adapter-input dropout has no such weight (its mask is per token) and is refused."""
        if self.quant is not None:
            raise ValueError("projection_weight needs a dense base; an NF4 weight is codes")
        check_factors(self)
        if self.has_adapter and self.lora_dropout and self.training:
            raise ValueError(f"this layer's adapter has dropout {self.lora_dropout:g} on its input, which no single "
                             "weight computes: set its lora_dropout to 0 (TRL's disable_dropout does) or call "
                             "the model's own forward")
        weight = self.adapted_weight().to(self.weight.dtype) if self.has_adapter else self.weight
        return self.token_rows.applied_to(weight) if self.replaces_columns else weight

    @torch.no_grad()
    def merge(self) -> None:
        """W := the merged weight (computed in fp32, rounded once); the adapter then adds nothing until ``unmerge``.
        Under DoRA the row norms of the unmerged weight are kept for ``unmerge``."""
        if self.quant is not None:
            raise ValueError("merging into NF4 weights would re-quantise them; export a merged checkpoint instead "
                             "(liger_models.lora.save_merged)")
        if self.token_adapter is not None:  # rows or an adapter, never both (add_token_rows)
            self.token_adapter.merge_into(self.weight)
            self.merged = True
        elif self.lora_A is not None and not self.merged:
            factor = self.dora_factor() if self.use_dora else None
            if factor is not None:
                self._merged_factor = factor
            self.weight.copy_(self.merged_weight(factor))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W := W / (m / n) − s·B·A (DoRA) or W − s·B·A: back up to the round trip's roundings, each of a value the
        size of W + s·B·A (a unit or two in its last place, more than W's own where the adapter outweighs W)."""
        if self.token_adapter is not None:
            self.token_adapter.unmerge_from(self.weight)
            self.merged = False
        elif self.merged:
            w = self.weight.float()
            if self.use_dora:
                w = w / self._merged_factor[:, None]
                del self._merged_factor
            self.weight.copy_(w - self.delta_weight())
            self.merged = False

    def extra_repr(self) -> str:
        base = "nf4" if self.quant is not None else "dense"
        return (f"in_features={self.in_features}, out_features={self.out_features}, base={base}, r={self.r}, "
                f"scaling={self.scaling:g}, dropout={self.lora_dropout:g}{', dora' if self.use_dora else ''}"
                f"{', merged' if self.merged else ''}")

    def composed(self, x: torch.Tensor) -> torch.Tensor:
        """The same output from plain ops (autocast, torch.compile, a trainable base, DoRA with dropout): the
        reference path."""
        weight = self.base_weight(x.dtype if self.quant is not None else None)
        y = F.linear(x, weight, self.bias)
        if not self.has_adapter:
            return y
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        lora = self.lora_B(self.lora_A(h.to(self.lora_A.weight.dtype))).to(y.dtype) * self.scaling
        if not self.use_dora:
            return y + lora
        factor = self.dora_factor().to(y.dtype)
        base = F.linear(h, weight) if h is not x else y if self.bias is None else y - self.bias
        return y + (factor - 1) * base + factor * lora

    def low_rank_terms(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, B) with this layer's output = F.linear(x, W, b) + u·Bᵀ, both in the dtype of F.linear's output for x
        (x's, or autocast's): u = drop(x)·(s·A)ᵀ (..., r) and B = lora_B's weight, differentiable (ordinary autograd
        reaches A, B and x). For a plain adapter on a dense base; the causal-LM loss hands them to the fused
        linear-cross-entropy, so an adapted lm_head never forms its output. s·A is formed in the adapter's dtype and
        rounded once to x's (r × in elements), so u is one GEMM with one rounding, as the fused core's x·Aᵀ is (which
        puts s into the B GEMM's alpha)."""
        if not self.has_adapter or self.use_dora or self.quant is not None:
            raise ValueError("low_rank_terms needs an unmerged plain LoRA adapter on a dense base (no DoRA, no NF4)")
        check_factors(self)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        u = F.linear(h, (self.lora_A.weight * self.scaling).to(x.dtype))
        return u, self.lora_B.weight.to(u.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = lora_packed_linear(x, [self])
        return self.token_rows.with_columns(x, y) if self.replaces_columns else y


_NORM_ROWS = 1024  # rows of W + s·B·A formed at a time for DoRA's norms (fp32: 4 × in_features bytes per row)
_DORA_TOKENS = 4096  # tokens per block when backward recomputes W·x for DoRA's dm


@torch.no_grad()
def dora_row_norms(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """‖W + s·B·A‖ per row, in fp32, one block of rows at a time."""
    a = lora_A.detach().to(device=weight.device, dtype=torch.float32)
    b = lora_B.detach().to(device=weight.device, dtype=torch.float32)
    norms = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], _NORM_ROWS):
        hi = min(lo + _NORM_ROWS, weight.shape[0])
        block = torch.addmm(weight[lo:hi].detach().float(), b[lo:hi], a, alpha=scaling)
        norms[lo:hi] = torch.linalg.vector_norm(block, dim=1)
    return norms


# ---- groups of sibling linears ------------------------------------------------------------------------------------

def is_lora_group(linears: list[nn.Module]) -> bool:
    """Some of ``linears`` are LoraLinear and the rest plain nn.Linear: the LoRA paths apply."""
    return (any(isinstance(lin, LoraLinear) for lin in linears)
            and all(isinstance(lin, LoraLinear) or is_plain_linear(lin) for lin in linears))


def check_factors(lin: "LoraLinear") -> None:
    """Refuses an adapter whose A or B is no longer a plain ``nn.Linear``: PEFT's ``get_peft_model`` (also through
    TRL's ``peft_config``) on a model that already carries these adapters wraps their A and B as linears of their own
    and freezes them, and the fused paths, which read A's and B's weights, would leave PEFT's adapters out, silently."""
    for name in ("lora_A", "lora_B"):
        factor = getattr(lin, name)
        if factor is not None and type(factor) is not nn.Linear:
            raise TypeError(f"a native LoRA adapter's {name} is a {type(factor).__module__}.{type(factor).__name__}: "
                            "another library (PEFT's get_peft_model, or TRL's peft_config) wrapped it, and the fused "
                            "paths read its weight without running it. Use native adapters (liger_models.lora) or "
                            "PEFT's on a model without them, not both")


def frozen_bases(linears: list[nn.Module]) -> bool:
    """The fused LoRA core applies: no base weight or bias needs a gradient (it computes none), and no DoRA
    adapter has its dropout active (that needs the base applied to the dropped input too; ``composed`` does it).
    Checks every adapter's factors first (``check_factors``): every LoRA path asks this before it runs."""
    for lin in linears:
        if isinstance(lin, LoraLinear):
            check_factors(lin)
    for lin in linears:
        for p in (getattr(lin, "weight", None), getattr(lin, "bias", None)):
            if p is not None and p.requires_grad:
                return False
        if isinstance(lin, LoraLinear) and lin.has_adapter and lin.use_dora and lin.lora_dropout and lin.training:
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
        self.dora = [j for j, i in enumerate(self.adapted) if linears[i].use_dora]  # positions among the adapted

    def adapter_params(self) -> list[torch.Tensor]:
        """A_1 … A_k, B_1 … B_k, then the DoRA magnitudes: the Function's differentiable inputs."""
        lins = [self.linears[i] for i in self.adapted]
        return ([lin.lora_A.weight for lin in lins] + [lin.lora_B.weight for lin in lins]
                + [lins[j].lora_magnitude_vector for j in self.dora])

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        ws = [lin.base_weight(dtype) if isinstance(lin, LoraLinear) and lin.quant is not None else lin.weight
              for lin in self.linears]
        return _stacked(ws)

    def bias(self) -> torch.Tensor | None:
        return _stacked([lin.bias for lin in self.linears]) if self.has_bias else None


def few_rows_on_nf4(x2: torch.Tensor, group: Group) -> bool:
    """The group holds NF4 bases and x2 is a decoding step's few rows, which kernels/ops/nf4_matmul.py multiplies
    decoding the codes in its K-loop (0.5 byte read a weight, where dequantising and stacking moves 4.5-8.5)."""
    if x2.shape[0] > rows_limit():  # every training step's forward: decided before looking at the siblings
        return False
    quants = [lin.quant for lin in group.linears if isinstance(lin, LoraLinear) and lin.quant is not None]
    return bool(quants) and all(rows_fit(x2, q.codes, q.shape) for q in quants)


def nf4_rows_product(x2: torch.Tensor, group: Group, out2d: torch.Tensor) -> None:
    """out2d := x2·Wᵀ + b, each sibling into its rows: NF4 ones by nf4_matmul, dense ones by one GEMM each."""
    for lin, (lo, hi) in zip(group.linears, group.rows):
        rows = out2d[:, lo:hi]
        quant = lin.quant if isinstance(lin, LoraLinear) else None
        if quant is not None:
            nf4_matmul(x2, quant.codes, quant.absmax, quant.shape, bias=lin.bias, out=rows)
        elif lin.bias is None:
            rows.copy_(x2 @ lin.weight.t())
        else:
            rows.copy_(torch.addmm(lin.bias, x2, lin.weight.t()))


def core_forward(x2: torch.Tensor, group: Group, params: list[torch.Tensor], out2d: torch.Tensor):
    """out2d := x2·Wᵀ + b + Σ s_i·(drop_i(x2)·A_iᵀ)·B_iᵀ into each adapter's rows, then each DoRA adapter's rows
    := b + (m / n) ⊙ (out − b); returns (xa, dropout draws (None where an adapter has none), DoRA norms n)."""
    if not group.dora and few_rows_on_nf4(x2, group):
        w, b = None, None
        nf4_rows_product(x2, group, out2d)
    else:
        w, b = group.weight(x2.dtype), group.bias()
        if b is None:
            torch.mm(x2, w.t(), out=out2d)
        else:
            torch.addmm(b, x2, w.t(), out=out2d)
    k = len(group.adapted)
    if not k:
        return None, [], []
    As = [a.to(x2.dtype) for a in params[:k]]
    Bs = [bm.to(x2.dtype) for bm in params[k:2 * k]]
    draws: GroupDraws | list = []
    if not group.any_dropout and x2.device.type == "cpu" and k > 1:
        # On the CPU one GEMM per adapter, as PEFT computes lora_A(x): torch 2.13's CPU fp32 GEMM (MKL) rounds a
        # product of up to 11 columns ~1.5x closer than one of 12 or more (mean relative error 1.2-1.4e-8 against
        # 2.0e-8 at K = 64), so q|k|v's x·A_catᵀ at r = 4 rounded worse than PEFT's three products and a large
        # adapter carried that into the logits (up to 6x HF + PEFT's fp32 error on a tiny Gemma 3). On a GPU the
        # one stacked product, reading x once, stays.
        xa = torch.cat([x2 @ a.t() for a in As], dim=1)
    elif not group.any_dropout:
        xa = x2 @ torch.cat(As).t()  # one thin GEMM for every adapter
    else:  # one pass over x2 drawing every adapter's mask (kernels/ops/dropout_matmul.py)
        draws = draws_for(x2, group.dropouts)
        xa = dropped_matmul(x2, torch.cat(As), group.ranks, draws)
    parts = xa.split(group.ranks, dim=1)
    for i, part, bm, s in zip(group.adapted, parts, Bs, group.scales):
        lo, hi = group.rows[i]
        out2d[:, lo:hi].addmm_(part, bm.t(), alpha=s)  # the GEMM adds into the packed output
    norms = []
    for j, m in zip(group.dora, params[2 * k:]):
        lo, hi = group.rows[group.adapted[j]]
        norms.append(dora_row_norms(w[lo:hi], params[j], params[k + j], group.scales[j]))
        factor = m.detach().float() / norms[-1]
        rows = out2d[:, lo:hi]
        if b is None:
            rows.mul_(factor)
        else:  # b + factor·(out − b)
            rows.mul_(factor).add_(b[lo:hi].float() * (1 - factor))
    return xa, draws, norms


def dora_scaled_grad(g: torch.Tensor, group: Group, params: list[torch.Tensor], norms: list) -> torch.Tensor:
    """dY with each DoRA adapter's rows times m / n: the gradient of the unscaled W·x + s·B·A·x."""
    if not group.dora:
        return g
    k = len(group.adapted)
    g = g.clone()
    for j, m, n in zip(group.dora, params[2 * k:], norms):
        lo, hi = group.rows[group.adapted[j]]
        g[:, lo:hi].mul_(m.detach().float() / n)
    return g


def backward_weight(group: Group, dtype: torch.dtype) -> torch.Tensor | None:
    """The group's base weight for a backward that needs it twice (dX, and DoRA's dm): one dequantisation of an NF4
    base instead of two. None without DoRA, where dX alone needs it and takes it itself (freed when dX is done)."""
    return group.weight(dtype) if group.dora else None


def core_backward_input(g: torch.Tensor, group: Group, params: list[torch.Tensor], xa: torch.Tensor | None,
                        draws: list, need_dx: bool, weight: torch.Tensor | None = None):
    """(dx or None, s·dY_i·B_i per adapter, dB per adapter). dx includes the adapters' path; under DoRA ``g`` is
    already scaled (``dora_scaled_grad``). ``weight``: the group's base weight when the caller has it already."""
    k = len(group.adapted)
    w = (weight if weight is not None else group.weight(g.dtype)) if need_dx else None
    dx = g @ w if need_dx else None
    if not k:
        return dx, [], []
    As = [a.to(g.dtype) for a in params[:k]]
    Bs = [bm.to(g.dtype) for bm in params[k:2 * k]]
    dxs, dBs = [], []
    xa_parts = xa.split(group.ranks, dim=1)
    for i, bm, s, part, bparam in zip(group.adapted, Bs, group.scales, xa_parts, params[k:2 * k]):
        lo, hi = group.rows[i]
        gi = g[:, lo:hi]
        dxs.append((gi @ bm) * s)
        dBs.append(((gi.t() @ part) * s).to(bparam.dtype))
    if need_dx:
        if not group.any_dropout:
            dx.addmm_(torch.cat(dxs, dim=1), torch.cat(As))
        else:  # each adapter's mask drawn on dx's tiles, the products summed before one rounding
            dropped_matmul_add(dx, torch.cat(dxs, dim=1), torch.cat(As), group.ranks, draws)
    return dx, dxs, dBs


def core_backward_A(dxs: list[torch.Tensor], x2: torch.Tensor, group: Group, params: list[torch.Tensor],
                    draws: list) -> list[torch.Tensor]:
    """dA per adapter: (s·dY_i·B_i)ᵀ·drop_i(x), one GEMM for all without dropout."""
    k = len(group.adapted)
    if not k:
        return []
    if not group.any_dropout:
        dA = torch.cat(dxs, dim=1).t() @ x2
    else:  # one pass over x2 drawing every adapter's mask, fp32 out
        dA = dropped_matmul_t(torch.cat(dxs, dim=1), x2, group.ranks, draws)
    return [d.to(a.dtype) for d, a in zip(dA.split(group.ranks), params[:k])]


def core_backward_magnitude(dout: torch.Tensor, x2: torch.Tensor, group: Group, params: list[torch.Tensor],
                            xa: torch.Tensor, norms: list, weight: torch.Tensor | None = None) -> list[torch.Tensor]:
    """dm per DoRA adapter: Σ_tokens dY ⊙ (W·x + s·B·A·x) / n (dY unscaled), W·x recomputed for its rows a block
    of tokens at a time and summed in fp32. ``weight``: the group's base weight when the caller has it already."""
    if not group.dora:
        return []
    k = len(group.adapted)
    w = weight if weight is not None else group.weight(x2.dtype)
    xa_parts = xa.split(group.ranks, dim=1)
    out = []
    for j, m, n in zip(group.dora, params[2 * k:], norms):
        lo, hi = group.rows[group.adapted[j]]
        bm = params[k + j].to(x2.dtype)
        total = torch.zeros(hi - lo, dtype=torch.float32, device=x2.device)
        for t in range(0, x2.shape[0], _DORA_TOKENS):
            z = x2[t:t + _DORA_TOKENS] @ w[lo:hi].t()
            z.addmm_(xa_parts[j][t:t + _DORA_TOKENS], bm.t(), alpha=group.scales[j])
            total += (dout[t:t + _DORA_TOKENS, lo:hi].float() * z.float()).sum(0)
        out.append((total / n).to(m.dtype))
    return out


class _LoraPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, *params):
        x2 = x.reshape(-1, x.shape[-1])
        out = x.new_empty((*x.shape[:-1], group.rows[-1][1]))
        xa, draws, norms = core_forward(x2, group, list(params), out.view(-1, out.shape[-1]))
        ctx.group, ctx.draws, ctx.norms, ctx.x_shape = group, draws, norms, x.shape
        ctx.save_for_backward(x2, xa, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, *params = ctx.saved_tensors
        dout = grad_out.reshape(-1, grad_out.shape[-1])
        g = dora_scaled_grad(dout, ctx.group, params, ctx.norms)
        w = backward_weight(ctx.group, g.dtype)
        dx, dxs, dBs = core_backward_input(g, ctx.group, params, xa, ctx.draws, ctx.needs_input_grad[0], w)
        dAs = core_backward_A(dxs, x2, ctx.group, params, ctx.draws)
        dMs = core_backward_magnitude(dout, x2, ctx.group, params, xa, ctx.norms, w)
        return (None if dx is None else dx.view(ctx.x_shape), None, *dAs, *dBs, *dMs)


def lora_packed_linear(x: torch.Tensor, linears: list[nn.Module]) -> torch.Tensor:
    """``cat([lin(x) for lin in linears], -1)`` for a LoRA group, base and adapters fused as described above."""
    fusable = frozen_bases(linears)  # first: it refuses wrapped factors, which the composed path would run too
    if torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling() or not fusable:
        return torch.cat([lin.composed(x) if isinstance(lin, LoraLinear) else lin(x) for lin in linears], dim=-1)
    group = Group(linears)
    return _LoraPacked.apply(x, group, *group.adapter_params())


register_group_path(is_lora_group, lora_packed_linear)
