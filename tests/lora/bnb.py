"""bitsandbytes for bit-exactness checks, imported without touching the network, or None."""

from __future__ import annotations

import sys


def import_bnb():
    """bitsandbytes' CPU backend asks HF's ``kernels`` package for a Hub-hosted GEMM at import (a download); with
    ``kernels`` masked that lookup fails at once and bitsandbytes falls back to its own CPU code."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    missing = object()
    saved = sys.modules.get("kernels", missing)
    sys.modules["kernels"] = None  # import of kernels raises ImportError
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401
    except Exception:
        return None
    finally:
        if saved is missing:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = saved
    return bitsandbytes
