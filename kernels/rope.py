"""Rotary position embedding (HF rotate_half / NeoX layout) on q and k together.

Math, per head and per token, with R the rotary dim (R ≤ D, even), h = R/2, x1 = x[:h], x2 = x[h:R]:
  y[:h]  = x1·cos[:h] − x2·sin[:h]
  y[h:R] = x2·cos[h:] + x1·sin[h:]
  y[R:]  = x[R:]                              (partial rotary passes the tail through)
i.e. y = x·cos + rotate_half(x)·sin with rotate_half(x) = cat(−x2, x1). HF's cos/sin are cat(freqs, freqs), so
the backward is the inverse rotation (sin → −sin):  dx1 = dy1·cos[:h] + dy2·sin[h:],  dx2 = dy2·cos[h:] − dy1·sin[:h].

HF numerics: HF casts cos/sin (computed in fp32) to the activation dtype and rotates in that dtype, rounding
each product. Here cos/sin stay fp32 and the math is fp32 with one rounding, which is closer to the float64
reference.
"""

from __future__ import annotations

import torch


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotation of q (B, T, Hq, D) and k (B, T, Hkv, D) with cos/sin (B or 1, T, R), fp32 math."""
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r, h = cos.shape[-1], cos.shape[-1] // 2
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    xr = x[..., :r].to(compute)
    c, s = cos.to(compute).unsqueeze(2), sin.to(compute).unsqueeze(2)  # (B or 1, T, 1, R)
    rotated = xr * c + torch.cat((-xr[..., h:], xr[..., :h]), dim=-1) * s
    return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, T, H, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    (b, t, _, d), (bk, tk, _, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, T and head_dim")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise TypeError(f"q and k must share one floating dtype, got {q.dtype} and {k.dtype}")
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(f"cos and sin must both be (B or 1, T, R), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos and sin must be float32 (RoPE angles stay fp32), got {cos.dtype} and {sin.dtype}")
    bc, tc, r = cos.shape
    if bc not in (1, b) or tc != t:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match q's batch {b} and length {t}")
    if r % 2 or r == 0 or r > d:
        raise ValueError(f"rotary dim {r} must be even, positive and ≤ head_dim {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a unit stride along head_dim (views of the projection output)")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("q, k, cos and sin must be on one device")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dims of every head of q (B, T, Hq, D) and k (B, T, Hkv, D); returns (q, k).

    cos/sin: (B or 1, T, R) float32 in HF layout (cat(freqs, freqs), attention scaling already applied), so
    explicit position ids (packed sequences) are expressed by the caller's cos/sin rows.
    """
    _check(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
