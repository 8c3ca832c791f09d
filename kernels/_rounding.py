"""Round-to-nearest-even casts that give the same bits in compiled Triton and in Triton's CPU interpreter.

Compiled Triton rounds fp32 → bf16 to nearest even; the interpreter (triton 3.6) truncates, which doubles the
rounding error CI would measure. Rounding the fp32 bits first makes the final cast exact on both, so the CPU
tests see GPU numerics. It costs a few integer ops per element, nothing next to the memory traffic.
"""

import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """fp32 ``x`` cast to ``dtype`` with round-to-nearest-even (inf and NaN preserved, overflow → inf)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
