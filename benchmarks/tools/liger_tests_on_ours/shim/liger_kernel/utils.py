"""liger_kernel.utils: the device queries Liger's tests and their conftest call."""

import torch


def infer_device() -> str:
    """"cuda" where a CUDA (or ROCm) GPU is present, else "cpu" (liger_models runs on no other accelerator)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_npu_available() -> bool:
    return False
