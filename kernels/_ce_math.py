"""fp32 helpers of the cross-entropy row kernel (_ce_core.py): softcap with its derivative, an accurate log1p."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_tanh(x, softcap):
    """(softcap·tanh(x/softcap), 1 − tanh²) in fp32 from one exp of a non-positive argument (no overflow)."""
    a = tl.abs(x) / softcap
    u = tl.exp(-2.0 * a)
    # (1−u)/(1+u) loses relative precision for small a: use tanh's Taylor series there (error < 1e-9 at a=0.1).
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.1, small, (1.0 - u) / (1.0 + u))
    t = tl.where(x < 0, -t, t)
    return softcap * t, 4.0 * u / ((1.0 + u) * (1.0 + u))


@triton.jit
def log1p(v):
    """log(1 + v) accurate for tiny v (Goldberg's trick; the interpreter has no libdevice)."""
    w = 1.0 + v
    d = w - 1.0
    return tl.where(d == 0.0, v, tl.log(w) * (v / tl.where(d == 0.0, 1.0, d)))
