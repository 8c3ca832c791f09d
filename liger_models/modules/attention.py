"""Causal self-attention: one QKV GEMM, fused RoPE in place on its output views, SDPA / flex attention, KV cache.

Numerics follow HF ``eager_attention_forward`` (scores · config.attention_scale, head_dim^-0.5 unless the family
says otherwise; fp32 softmax inside SDPA; GQA query head h reads kv head h // (Hq/Hkv); Gemma 2's score soft-cap
c·tanh(s/c) before the mask, see ``attend``). Which keys a query at absolute index i may see:
  causal       j ≤ i
  window W     i − j < W                    (exactly W keys including itself; HF eager/SDPA convention)
  documents    doc[j] == doc[i]             (packed sequences: position_ids that do not step by +1 start a new doc)
  padding      attention_mask[j] == 1       as HF: a padded query too sees only real keys; one that has none in
                                             its range sees itself (an empty row would give NaN in SDPA, which would
                                             then leak into real rows through the padded values)
Paths, chosen per call: SDPA ``is_causal`` when only causality matters (the fast path; no mask tensor); on CUDA for
long sequences that need windows or documents, ``flex_attention`` with a block mask (memory O(T), never a T×T
tensor); a speculative tree's verification call (inference), liger_models/kernels/ops/decode_attention.py (the keys split over
programs); otherwise SDPA with an explicit boolean mask (CPU, short sequences, chunked prefill). Soft-capped scores
(no SDPA hook): this project's Triton kernel for CUDA training calls (its TUNING.preferred), flex_attention with a
score_mod on CUDA from FLEX_MIN_LEN queries for the calls it does not take, else HF eager's math.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from liger_models.kernels.ops import decode_attention as decode_attention_kernels
from liger_models.kernels.ops import softcap_attention as softcap_attention_kernels
from liger_models.kernels._dispatch import use_triton
from liger_models.kernels.ops.qk_norm_rope import qk_norm_rope
from liger_models.kernels.ops.rope import rope_packed

from .cache import KVCache
from .config import LigerConfig
from .linear import packed_linear
from .norm import make_norm

FLEX_MIN_LEN = 512  # below this a boolean mask is cheap and SDPA avoids flex's compile
# SDPA's CUDA kernels fail past two limits with a CUDA fault, not an error (pytorch#142228, flash-attention#1500; at
# Llama-8B head shapes B=8192 × T=1 gives an illegal memory access in backward, B=65536 `invalid argument`): the batch
# is a grid axis of at most 65535 blocks, and FlashAttention's backward indexes its dq accumulator with 32-bit ints,
# past batch · heads · round_up(T, 128) · max(head_dim, 32) = 2³¹. Such a batch is attended in chunks (_sdpa).
SDPA_MAX_ROWS = 65535
FLASH_BACKWARD_ELEMENTS = 2**31
_SDPA_LIMITED = ("cuda",)  # device types whose SDPA kernels have those limits


# Dynamo compiles flex_attention once per distinct call (dtype, head shape, GQA, mask and score functions, a shape
# turning dynamic), and every torch.compile of it in a process shares one count. Past ``recompile_limit`` (8 by
# default) dynamo would run it uncompiled: unfused, a T×T score tensor per call, and a CPU constant that CUDA graph
# capture refuses. A process that trains or evaluates several models reaches 8 (the GPU test suite did), so the
# compiled calls lift the limit to this, and fullgraph=True turns a fallback past it into an error, never a silent
# O(T²) path.
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, fullgraph=True)


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """flex_attention, compiled on CUDA (uncompiled it materialises the scores: fine only for the CPU tests); inside
    a compiled model dynamo traces it into the model's graph."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kwargs)
    compiled = _compiled_flex()
    config = torch._dynamo.config  # set and restored directly: config.patch costs ~5x as much host time per call
    previous = config.recompile_limit
    config.recompile_limit = max(previous, FLEX_RECOMPILE_LIMIT)
    try:
        return compiled(q, k, v, **kwargs)
    finally:
        config.recompile_limit = previous


_STATIC_DOCUMENT_MASK = [False]


@contextlib.contextmanager
def static_document_mask():
    """Within this context, position_ids always get the document mask (``document_ids`` never returns None).

    Why: whether a batch holds one document per row is a host read of device data. A CUDA graph can neither make
    that read nor switch attention paths between replays, so its eager warm-up and its capture must take the
    masked path every time (cuda_graph.py); the mask of a one-document row allows exactly the causal pairs.
    """
    previous, _STATIC_DOCUMENT_MASK[0] = _STATIC_DOCUMENT_MASK[0], True
    try:
        yield
    finally:
        _STATIC_DOCUMENT_MASK[0] = previous


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, T) index of the packed document each token belongs to, or None when every row is one document.
    Always the former while torch.compile traces: the host read would break the graph (as for static_document_mask)."""
    start = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=start, dim=-1) != 1).cumsum(-1)
    if _STATIC_DOCUMENT_MASK[0] or torch.compiler.is_compiling():
        return docs
    return docs if bool(docs[:, -1].any()) else None


class AttentionMask:
    """Which keys each query sees in one forward call; the masks each layer needs are built once and shared."""

    def __init__(self, q_len: int, past: int | torch.Tensor, documents: torch.Tensor | None, device: torch.device,
                 padding: torch.Tensor | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                 capacity: int | None = None) -> None:
        """padding: (B, past + q_len) bool, True for real tokens (HF's 2D attention_mask), or None.
        tree: (mask (q_len, q_len) bool, depth (q_len,) long) for a call whose new tokens form a tree (Medusa's
        verification): new token i sees the whole cache and the new tokens j with mask[i, j] (its ancestors and
        itself) instead of those before it; a new token's position is past + depth, which is what a window counts.
        capacity: the keys are a static cache's ``capacity`` slots (a CUDA-graphed call, modules/graphed_decoding.py)
        and ``past`` a 0-dim device tensor, or (B, 1, 1) when each row starts at its own slot, so the mask is
        computed on the device at every replay; slots past the call's tokens are hidden, and padding is
        (B, capacity). Such a mask is never a flex BlockMask."""
        self.q_len, self.past = q_len, past
        self.kv_len = past + q_len if capacity is None else capacity
        self.documents, self.padding, self.device = documents, padding, device
        self.tree = tree
        self.supports_flex = capacity is None  # whether `block` can build a flex_attention BlockMask
        self._masks: dict = {}

    @property
    def batch(self) -> int | None:
        """Rows with their own mask, or None when every row shares one."""
        for per_row in (self.documents, self.padding):
            if per_row is not None:
                return per_row.shape[0]
        return None

    def needs_mask(self, window: int | None) -> bool:
        return self.batch is not None or self.tree is not None or (window is not None and window < self.kv_len)

    def _allowed(self, q_idx, kv_idx, window: int | None, b=None):
        if self.tree is None:
            ok = kv_idx <= q_idx + self.past
            q_pos, kv_pos = q_idx + self.past, kv_idx
        else:
            mask, depth = self.tree
            offset = kv_idx - self.past
            cached, new = offset < 0, offset.clamp(0, self.q_len - 1)
            ok = cached | ((offset < self.q_len) & mask[q_idx, new])  # a static cache's later slots are hidden
            q_pos, kv_pos = self.past + depth[q_idx], torch.where(cached, kv_idx, self.past + depth[new])
        if window is not None:
            ok = ok & (q_pos - kv_pos < window)
        if self.documents is not None:
            ok = ok & (self.documents[b, q_idx] == self.documents[b, kv_idx])
        if self.padding is not None:
            q_slot = q_idx + self.past
            alone = (kv_idx == q_slot) & ~self._sees_a_real_key(window)[b, q_slot]
            ok = ok & (self.padding[b, kv_idx] | alone)
        return ok

    def _sees_a_real_key(self, window: int | None) -> torch.Tensor:
        """(B, S) bool: whether the query in each slot has a real (unpadded) key among those causality and the
        window allow it (slots i − W < j ≤ i). A padded query between real tokens (PEFT's virtual tokens before a
        left-padded prompt, right padding) then attends as HF's does; documents never come with padding."""
        if ("sees", window) not in self._masks:
            real = self.padding.to(torch.int32).cumsum(-1)  # real keys in slots ≤ i
            if window is not None and window < real.shape[-1]:
                real = real - F.pad(real, (window, 0))[:, : real.shape[-1]]  # minus those in slots ≤ i − W
            self._masks[("sees", window)] = real > 0
        return self._masks[("sees", window)]

    def boolean(self, window: int | None) -> torch.Tensor:
        """(B or 1, 1, T, past + T or capacity) True where attention is allowed."""
        if ("bool", window) not in self._masks:
            q_idx = torch.arange(self.q_len, device=self.device)[None, :, None]  # (1, T, 1)
            kv_idx = torch.arange(self.kv_len, device=self.device)[None, None, :]  # (1, 1, S)
            b = None if self.batch is None else torch.arange(self.batch, device=self.device)
            allowed = self._allowed(q_idx, kv_idx, window, None if b is None else b[:, None, None])
            self._masks[("bool", window)] = allowed[:, None]  # (B or 1, 1, T, S)
        return self._masks[("bool", window)]

    def block(self, window: int | None):
        """flex_attention BlockMask for the same rule."""
        if ("block", window) not in self._masks:
            batch = self.batch
            mask_mod = lambda b, h, q_idx, kv_idx: self._allowed(q_idx, kv_idx, window, b)  # noqa: E731
            self._masks[("block", window)] = create_block_mask(
                mask_mod, batch, None, self.q_len, self.kv_len, device=self.device)
        return self._masks[("block", window)]


def _flash_backward_elements(heads: int, q_len: int, head_dim: int) -> int:
    # What FlashAttention's backward indexes per batch row: T padded to its 128-query blocks, head_dim to 32.
    return heads * -(-q_len // 128) * 128 * max(head_dim, 32)


def sdpa_rows_per_call(heads: int, q_len: int, head_dim: int, backward: bool) -> int:
    """The most batch rows one CUDA SDPA call takes within its limits (module constants); at least 1."""
    if not backward:
        return SDPA_MAX_ROWS
    return min(SDPA_MAX_ROWS, max(1, FLASH_BACKWARD_ELEMENTS // _flash_backward_elements(heads, q_len, head_dim)))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, called on chunks of the batch where one call would pass SDPA's CUDA limits
    (a shape check: normal batches take the single call)."""
    if q.device.type not in _SDPA_LIMITED:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    B, H, T, D = q.shape
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    flash = attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)  # SDPA may pick FlashAttention
    if backward and flash and _flash_backward_elements(H, T, D) > FLASH_BACKWARD_ELEMENTS:
        raise ValueError(f"attention over one sequence of {T} tokens × {H} heads × head_dim {D} is past "
                         "FlashAttention's 32-bit backward index range (heads · T · head_dim ≤ 2^31, T rounded "
                         "up to 128): train on shorter sequences")
    rows = sdpa_rows_per_call(H, T, D, backward)
    if rows >= B:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    chunks = []
    for first in range(0, B, rows):
        part = slice(first, first + rows)
        part_mask = attn_mask if attn_mask is None or attn_mask.shape[0] == 1 else attn_mask[part]
        chunks.append(F.scaled_dot_product_attention(q[part], k[part], v[part], attn_mask=part_mask, **kwargs))
    return torch.cat(chunks)


@functools.cache
def _softcap_score_mod(softcap: float, device: torch.device | None):
    """flex_attention score_mod c·tanh(s / c); flex hands it the already scaled (fp32) score and masks after it.
    One function object per cap and device: a fresh closure per call would fail the compiled flex's guards.

    Called eagerly (device given), the cap is a captured fp32 tensor: with a Python float, a second cap value in one
    process (two models, a test suite) makes torch.compile recompile flex with the float unspecialised, and
    inductor's flex lowering fails on the scalar it becomes (``LoweringException: unbacked_bindings``, torch 2.11
    and 2.13); a captured tensor is a kernel input, so another cap neither recompiles nor breaks. Traced inside an
    outer torch.compile (device None) the cap stays a float: a tensor made there is a graph intermediate, which
    inductor's CPU flex template has no lowering for."""
    cap = softcap if device is None else torch.full((), softcap, dtype=torch.float32, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


def attend_softcapped_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                           scale: float, softcap: float) -> torch.Tensor:
    """HF eager's soft-capped attention, op for op: s = (q kᵀ)·scale, s = c·tanh(s / c) in the activation dtype,
    masked keys to −inf, softmax in fp32, cast back, · v. Forms the (B, Hq, T, S) scores: the CPU and short-call
    path (SDPA has no score hook); long CUDA calls take flex_attention. allowed: (B or 1, 1, T, S) bool or None."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head h reads kv head h // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _kernel_takes(q: torch.Tensor, k: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether the soft-capped attention kernel computes this call: a training-shaped one (no cache, padding or
    tree; causal, window and documents are what the kernel masks) on tensors the Triton kernels run on."""
    return (mask.tree is None and mask.padding is None and mask.supports_flex and isinstance(mask.past, int)
            and mask.past == 0 and k.shape[2] == q.shape[2] and use_triton(q))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, window: int | None,
           scale: float, flex: str = "auto", softcap: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v for q (B, Hq, T, D), k/v (B, Hkv, S, D) → (B, Hq, T, D).

    flex: "auto" (CUDA and T ≥ FLEX_MIN_LEN when a mask is needed), "always" or "never" (tests pick the path);
    "kernel": soft-capped calls the kernel takes run it whatever its TUNING prefers (the rest as "auto").
    softcap: scores ← c·tanh(scores / c) between the scaling and the mask (Gemma 2). SDPA has no hook for it, so
    such a call runs this project's soft-capped attention kernel ("auto": on CUDA, where its TUNING prefers it and
    the call is a training-shaped one it masks: liger_models/kernels/ops/softcap_attention.py), flex_attention with
    a score_mod ("auto": on CUDA from FLEX_MIN_LEN queries, causal or not; "always" runs it uncompiled on the CPU for
    tests) or else the eager math (``attend_softcapped_math``).
    """
    if softcap is not None:
        if ((flex == "kernel" or (flex == "auto" and q.is_cuda and softcap_attention_kernels.TUNING.preferred))
                and _kernel_takes(q, k, mask)):
            return softcap_attention_kernels.softcap_attention(q, k, v, scale, softcap, window, mask.documents)
        use_flex = mask.supports_flex and mask.tree is None and (
            flex == "always" or (flex == "auto" and q.is_cuda and mask.q_len >= FLEX_MIN_LEN))
        if use_flex:
            cap_device = None if torch.compiler.is_compiling() else q.device
            return _flex_attention(q, k, v, score_mod=_softcap_score_mod(softcap, cap_device),
                                   block_mask=mask.block(window), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return attend_softcapped_math(q, k, v, mask.boolean(window), scale, softcap)
    gqa = q.shape[1] != k.shape[1]
    if (mask.tree is not None and mask.q_len >= decode_attention_kernels.TUNING.min_queries
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and decode_attention_kernels.runs_kernel(q, k, v)):
        # A speculative tree (or a graphed decoding call): tens of queries over the whole cache, where SDPA's
        # kernels do not split the keys.
        return decode_attention_kernels.decode_attention(q, k, v, mask.boolean(window), scale)
    if not mask.needs_mask(window):
        if mask.past == 0:
            return _sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        if mask.q_len == 1:  # one new token sees the whole cache
            return _sdpa(q, k, v, scale=scale, enable_gqa=gqa)
    elif mask.supports_flex and (flex == "always" or (flex == "auto" and q.is_cuda and mask.q_len >= FLEX_MIN_LEN)):
        return _flex_attention(q, k, v, block_mask=mask.block(window), scale=scale, enable_gqa=gqa)
    return _sdpa(q, k, v, attn_mask=mask.boolean(window), scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    """HF-named projections (q_proj/k_proj/v_proj/o_proj, or Phi3's qkv_proj) around fused RoPE and SDPA."""

    def __init__(self, config: LigerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.softcap = config.attention_softcap
        self.window = config.layer_sliding_window(layer_idx)
        hidden, q_out, kv_out = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if config.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, q_out + 2 * kv_out, bias=config.qkv_bias)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=config.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = make_norm(config, self.head_dim), make_norm(config, self.head_dim)
        self.flex = "auto"

    def packed_groups(self) -> list[list[nn.Linear]]:
        return [] if hasattr(self, "qkv_proj") else [self.projections()]

    def projections(self) -> list[nn.Linear]:
        """The linears whose outputs, concatenated, are q | k | v (one GEMM: ``packed_linear``)."""
        return [self.qkv_proj] if hasattr(self, "qkv_proj") else [self.q_proj, self.k_proj, self.v_proj]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                cache: KVCache | None = None) -> torch.Tensor:
        return self.from_qkv(packed_linear(x, self.projections()), cos, sin, mask, cache)

    def from_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                 cache: KVCache | None = None) -> torch.Tensor:
        """Attention from the packed projection output qkv (B, T, (Hq + 2 Hkv) D), a base tensor rope may rotate."""
        B, T, _ = qkv.shape
        if hasattr(self, "q_norm") and self._fused_qk_norm(qkv, cos):
            q, k, v = qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.num_heads,
                                   self.num_kv_heads, self.head_dim, self.q_norm.eps, self.q_norm.offset,
                                   self.q_norm.casting)
        else:
            if hasattr(self, "q_norm"):
                qkv = self._norm_heads(qkv)
            # (B, T, H, D) views with q and k rotated in place; d qkv comes back as one tensor (see liger_models/kernels/ops/rope.py).
            q, k, v = rope_packed(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, past + T, D)
        out = attend(q, k, v, mask, self.window, self.scale, self.flex, self.softcap)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def _fused_qk_norm(self, qkv: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether the q/k norms and RoPE run as one kernel pass (liger_models/kernels/ops/qk_norm_rope.py): where the
        Triton kernels run, the whole head is rotated, and the norms are the plain modules with one eps."""
        return (use_triton(qkv) and cos.shape[-1] == self.head_dim
                and self.q_norm.eps == self.k_norm.eps and self.q_norm.offset == self.k_norm.offset
                and not (self.q_norm._forward_hooks or self.q_norm._forward_pre_hooks
                         or self.k_norm._forward_hooks or self.k_norm._forward_pre_hooks))

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """[q_norm(q) | k_norm(k) | v] as a fresh packed tensor, for ``rope_packed``: the unfused path (the PyTorch
        reference, partial rotary). Each head's d features are normalised by the RMSNorm kernel (one
        launch for all q heads, one for all k heads; the (B, T, H, d) views are its rows); the concatenation costs
        one copy of qkv, which rope then rotates in place (nothing else saves that copy)."""
        q_end, k_end = self.num_heads * self.head_dim, (self.num_heads + self.num_kv_heads) * self.head_dim
        lead = qkv.shape[:-1]
        q = self.q_norm(qkv[..., :q_end].view(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[..., q_end:k_end].view(*lead, self.num_kv_heads, self.head_dim))
        return torch.cat((q.flatten(-2), k.flatten(-2), qkv[..., k_end:]), dim=-1)
