"""GeGLU forward + backward (bf16): this project vs eager PyTorch, torch.compile and liger-kernel 0.8.5.

Same protocol as bench_swiglu.py (eager = HF `gelu(gate) * up` in bf16 on separate projection outputs;
this project also on the fused (rows, 2I) output). The tanh approximation is Gemma's; exact erf GELU is
timed at the headline shape too (liger-kernel's LigerGELUMulFunction is tanh-only).

    python benchmarks/bench_geglu.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from bench_swiglu import SWEEP, liger_fn, bench_gated
from harness import parse_args


def main() -> None:
    from liger_models.kernels.ops.geglu import geglu, geglu_packed

    args = parse_args(__doc__)
    tanh = dict(eager_act=partial(F.gelu, approximate="tanh"), ours=geglu, ours_packed=geglu_packed,
                liger=liger_fn("liger_kernel.ops.geglu", "LigerGELUMulFunction"))
    erf = dict(eager_act=F.gelu, ours=partial(geglu, approximate="none"),
               ours_packed=partial(geglu_packed, approximate="none"), liger=None)
    cases = [("16384x16384", 16384, 16384, tanh), ("16384x16384 erf", 16384, 16384, erf)]
    if not args.quick:
        cases += [(f"{r}x{i}", r, i, tanh) for r, i in SWEEP]
    bench_gated("geglu", args, cases)


if __name__ == "__main__":
    main()
