"""bitsandbytes' AdamW variants, for runs whose optimizer state does not fit: ``--optimizer adamw_8bit`` (moments
quantised to 8 bits in blocks of 256 with a per-block scale: 2 bytes per parameter instead of 8 in fp32 or 4 in
bf16), ``paged_adamw_32bit`` (fp32 moments in CUDA unified memory, which the driver pages out to host memory when
the GPU runs short instead of failing) and ``paged_adamw_8bit`` (both). The names are HF Trainer's ``optim`` ones.

bitsandbytes is an optional dependency (``pip install 'liger-models[bnb]'``), imported only when one of these is
chosen. Their math is AdamW's with the same decoupled weight decay; in 8 bits the moments are rounded at every step,
so a run differs from an fp32-moment one by that rounding (the 8-bit paper's result: same loss curves at LLM scale).
Tensors under 4096 elements keep fp32 moments (bitsandbytes' ``min_8bit_size``). On the CPU, paged ones fall back to
ordinary tensors (bitsandbytes warns once).

What they do not do here: FSDP2 (bitsandbytes' update kernels take plain tensors, not DTensor shards), CUDA graphs
(their step is not capturable) and torch's AMP grad scaling; the recipes refuse those combinations up front.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

import torch

BNB_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw_32bit": "PagedAdamW",
                  "paged_adamw_8bit": "PagedAdamW8bit"}  # our names (HF Trainer's) → bitsandbytes.optim classes
OPTIMIZERS = ("adamw", *BNB_OPTIMIZERS)  # --optimizer's choices: optim.py's AdamW, then bitsandbytes' ones


def import_bitsandbytes():
    """bitsandbytes, imported without touching the network: on a CPU with AVX-512 BF16 its import asks HF's
    ``kernels`` package for a Hub-hosted GEMM (a download). With ``kernels`` hidden for the import that lookup fails
    at once (its warning about that silenced) and bitsandbytes keeps its own CPU code, which is all an optimizer
    needs. ImportError saying how to install it where it is missing."""
    if sys.modules.get("bitsandbytes") is not None:
        return sys.modules["bitsandbytes"]
    missing = object()
    saved = sys.modules.get("kernels", missing)
    sys.modules["kernels"] = None  # `import kernels` raises ImportError
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")  # where it warns that the lookup failed
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ImportError(f"bitsandbytes does not import ({exc}): pip install bitsandbytes") from exc
    finally:
        cpu_ops.setLevel(level)
        if saved is missing:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = saved
    return bitsandbytes


def check_optimizer(name: str, *, distributed: bool, cuda_graph: bool, adamw: str = "liger") -> None:
    """ValueError for an unknown ``--optimizer``, for a bitsandbytes one with what it cannot go with (every conflict
    named), and for one whose bitsandbytes does not import. The recipes check this before loading anything."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {name}: choose from {', '.join(OPTIMIZERS)}")
    if name == "adamw":
        return
    problems = [why for holds, why in (
        (distributed, "FSDP2 (several processes: its update takes plain tensors, not DTensor shards)"),
        (cuda_graph, "--cuda-graph (its step is not capturable)"),
        (adamw != "liger", f"--adamw {adamw} (which picks the step of --optimizer adamw)")) if holds]
    if problems:
        raise ValueError(f"--optimizer {name} is bitsandbytes' optimizer, so it cannot be combined with "
                         + ", ".join(problems))
    try:
        import_bitsandbytes()
    except ImportError as exc:
        raise ValueError(f"--optimizer {name}: {exc}") from exc


def build_bnb_adamw(name: str, param_groups: list[dict], *, betas: tuple[float, float], eps: float = 1e-8,
                    full_precision: Sequence[torch.Tensor] = ()) -> torch.optim.Optimizer:
    """bitsandbytes' ``name`` optimizer (a key of :data:`BNB_OPTIMIZERS`) over ``param_groups``, each group with its
    own lr and weight_decay. ``full_precision``: parameters whose moments stay 32-bit in an 8-bit optimizer; the
    recipes pass the embeddings, as bitsandbytes advises (8-bit moments of rarely updated rows are unstable) and HF
    Trainer does.

    The per-parameter settings live in a manager of this optimizer's own. bitsandbytes' default one is global to the
    process and remembers overrides by parameter position as well as by identity: after HF Trainer has set up an
    8-bit optimizer in the same process, the first parameter of any later optimizer silently got that model's
    embedding setting (found by the tests, which run both)."""
    if name not in BNB_OPTIMIZERS:
        raise ValueError(f"unknown bitsandbytes optimizer {name!r}; choose from {', '.join(BNB_OPTIMIZERS)}")
    bnb = import_bitsandbytes()
    optimizer = getattr(bnb.optim, BNB_OPTIMIZERS[name])(param_groups, betas=betas, eps=eps)
    manager = bnb.optim.GlobalOptimManager.__new__(bnb.optim.GlobalOptimManager)  # its __init__ refuses: a singleton
    manager.initialize()
    optimizer.mng = manager
    if full_precision and name.endswith("8bit"):
        manager.override_config(list(full_precision), "optim_bits", 32)
    return optimizer
