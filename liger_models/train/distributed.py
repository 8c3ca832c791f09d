"""Multi-process training from outside the model: torchrun setup, FSDP2 sharding, activation checkpointing, and
full (gathered) state dicts for checkpoints.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is applied per decoder layer (and per Medusa head) and then to the
root module, the layout torchtitan uses: each unit's parameters are all-gathered just before it runs and freed after,
while the root group (embeddings, final norm, lm_head) stays gathered for the whole forward. FSDP2 averages
gradients over ranks; the loss is already normalised by the global token count, so the trainer multiplies each
rank's loss by the world size to turn that average into the needed sum (``set_gradient_divide_factor(1)`` would
say the same, but it needs PREMUL_SUM, which gloo lacks).

Checkpoints hold full tensors: :func:`full_model_state` and :func:`full_optimizer_state` gather them (on CPU, on
rank 0 only) through ``torch.distributed.checkpoint.state_dict``; the optimizer state is keyed by parameter name, so a
checkpoint written by N ranks resumes on M ranks or on one process. A LoRA checkpoint needs only what trains:
:func:`full_trained_state` gathers the adapters (and any other trainable parameter), never the frozen base.

A mixture-of-experts model's load-balancing loss is not a sum over tokens, so the ranks compute it over the global
micro-batch together (:func:`balanced_over_ranks`), as one process would over the same batch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from liger_models.modules.moe import balancing_over_ranks, stacked_state_dict
from liger_models.train.optim import with_live_flags


@dataclass
class DistInfo:
    """Where this process stands: rank, world size and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the torchrun process group when launched by torchrun (NCCL on CUDA, gloo on CPU), else run alone.

    ``device``: "cuda" / "cpu" / None (CUDA when available). Each rank uses GPU ``LOCAL_RANK``.
    """
    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but CUDA is not available")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        # Otherwise set_device fails with CUDA's "invalid device ordinal", which names neither cause.
        raise RuntimeError(f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but this process sees "
                           f"{torch.cuda.device_count()} GPU(s): launch at most that many processes per node "
                           "(torchrun --nproc-per-node), or check CUDA_VISIBLE_DEVICES")
    dev = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", device_id=dev if device_type == "cuda" else None)
    return DistInfo(rank, world, local_rank, dev)


def destroy_distributed(clean: bool = True) -> None:
    """Leave the process group (a no-op when running alone).

    ``clean`` (the run finished on this rank): first meet every other rank at a barrier, so no rank tears its
    connections down while a peer still finishes its last collectives. After an exception, leave at once: a barrier
    could wait forever for a rank that died. Free every FSDP module first (recipes/training.py's in_process_group
    does): one that outlives the group destroys its connections from whichever thread next collects garbage, and
    aborts the process."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place (a no-op when running alone)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value`` (``value`` itself when running alone): one 8-byte all-reduce."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def balanced_over_ranks():
    """A context in which a mixture-of-experts load-balancing loss is each rank's share of the global micro-batch's
    (modules/moe.py ``balancing_over_ranks``); nothing to do when running alone."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return contextlib.nullcontext()
    return balancing_over_ranks(all_reduce_sum)


def apply_activation_checkpointing(layers: Iterable[nn.Module]) -> int:
    """Recompute each layer's activations in backward instead of keeping them (non-reentrant checkpointing).

    The layer's ``forward`` is wrapped on the instance, so parameter names and ``state_dict`` keys do not change
    (a wrapper module would add a prefix), and marked ``checkpointed`` (a decoder layer then gets one stream tensor
    to keep, not the (x, residual) pair: modules/decoder.py). Returns how many layers were wrapped.
    """
    count = 0
    for layer in layers:
        if getattr(layer, "checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer.checkpointed = True
        count += 1
    return count


def apply_fsdp(root: nn.Module, units: Iterable[nn.Module], device: torch.device, *,
               reduce_fp32: bool = True) -> nn.Module:
    """Shard ``units`` (decoder layers; Medusa heads) one by one, then ``root`` (FSDP2 ``fully_shard``); ``root``
    becomes an FSDPModule in place. A unit's parameters are gathered only while its forward / backward runs.

    ``reduce_fp32``: reduce-scatter gradients in fp32 even when the parameters are bf16 (one rounding at the end
    instead of one per rank); the sharded gradients keep the parameters' dtype.
    """
    # Imported when sharding: torch builds without distributed support lack these modules, and a single process
    # never needs them.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # An explicit mesh: the default one follows CUDA availability, not the device the model is on.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_fp32 else None)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The complete (unsharded) state dict on CPU; on rank 0 only when distributed (empty elsewhere). Experts stay
    stacked under their module names (moe.stacked_state_dict), which ``load_state_dict`` takes as they are."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with stacked_state_dict():
        return get_model_state_dict(model, options=_FULL)


def full_trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter that trains (requires grad), whole, on CPU, by parameter name; on rank 0 only when distributed
    (empty elsewhere). Gathered one tensor at a time, in ``named_parameters`` order on every rank, so a frozen base
    is never gathered."""
    keep = not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        if keep:
            state[name] = whole.detach().to("cpu", copy=True)
    return state


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, unsharded, on CPU (rank 0 only when distributed)."""
    options = _FULL if dist.is_initialized() else StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    for group in state.get("param_groups", []):  # a CUDA graph's 0-dim lr tensor is saved as its value
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load what :func:`full_optimizer_state` returned; every rank passes the same full ``state``.

    Implementation flags (fused / foreach) follow the current optimizer, so a CUDA checkpoint resumes on CPU.
    """
    # set_optimizer_state_dict maps groups by position: saved groups beyond the live ones are dropped.
    groups = with_live_flags(state["param_groups"], optimizer.param_groups)[: len(optimizer.param_groups)]
    state = {"state": state["state"], "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
