"""liger_kernel.ops.utils: the platform query the tests read."""

import torch


def is_hip() -> bool:
    return torch.version.hip is not None
