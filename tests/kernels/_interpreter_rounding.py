"""Make Triton's CPU interpreter round fp32 → bf16 casts to nearest-even, as the GPU does.

Triton 3.6's interpreter truncates fp32 → bf16 (its ``_convert_float`` drops the low mantissa bits, even when
asked for "rtne"), so every bf16 output of a kernel run under ``TRITON_INTERPRET=1`` carries up to one bf16 ulp of
extra error that the real kernel does not have. Importing the fixture below into a test module swaps in a correct
conversion for the duration of each test. (Candidate for tests/conftest.py: every kernel test needs it.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from liger_models.kernels._dispatch import interpreting


@pytest.fixture(autouse=True)
def interpreter_rounds_bf16(monkeypatch):
    if not interpreting():
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        rtz = rounding_mode is not None and "RTZ" in str(rounding_mode)
        if src == tl.float32 and dst == tl.bfloat16 and not rtz:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return truncating(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    yield
