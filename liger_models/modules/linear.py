"""One GEMM for several projections of the same input (q|k|v, gate|up) while parameters keep HF names.

``pack_linears_`` re-points the weights (and biases) of sibling ``nn.Linear`` modules into one contiguous buffer,
keeping each Parameter object (``param.data = view``), so ``state_dict`` keys, optimizers and ``named_parameters``
are unchanged. ``packed_linear`` then runs a single GEMM against the aliasing (sum of rows, in) view; its backward
computes dX and the stacked dW with one GEMM each and hands every parameter its slice. When the parameters are not
back to back in memory (e.g. after ``load_state_dict(assign=True)`` or under FSDP) it concatenates them on the fly,
in forward and again in backward, so nothing weight-sized is ever saved for backward.

The fused paths read ``weight`` and ``bias`` of plain ``nn.Linear`` modules only (``is_plain_linear``). A projection
that PEFT wrapped with LoRA, that a library replaced (a quantised linear) or that carries forward hooks is called as
a module instead, so whatever it adds takes part exactly, at the unfused speed.

``state_dict()`` (keep_vars=False, what every saver calls) gives each packed weight as its own tensor, copied out
of the shared buffer: safetensors, accelerate and transformers' savers treat views of one storage as shared tensors
and drop or refuse them. ``state_dict(keep_vars=True)`` and ``named_parameters`` still give the packed Parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_hooks


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors stacked along dim 0: an aliasing view when they lie back to back in one storage, else a copy."""
    first = tensors[0]
    # Storage pointers do not exist while torch.compile traces (fake tensors): concatenate there. (The custom ops
    # run this on the real tensors, so a compiled graph still uses the aliasing view.)
    if first.device.type == "meta" or torch.compiler.is_compiling():
        return torch.cat([t.detach() for t in tensors])
    offset = first.storage_offset()
    aliased = True
    for t in tensors:
        if (not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            aliased = False
            break
        offset += t.numel()
    if not aliased:
        return torch.cat([t.detach() for t in tensors])
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


class _PackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = list(params[:n]), list(params[n:])
        ctx.n, ctx.has_bias = n, bool(biases)
        ctx.rows = [w.shape[0] for w in weights]
        ctx.save_for_backward(x, *weights)
        # Written through ``out=`` so the result is a base tensor, not a view made inside a custom Function:
        # the rope kernel later rotates q and k in place in it, which autograd forbids on such views.
        w = _stacked(weights)
        out = x.new_empty((*x.shape[:-1], w.shape[0]))
        x2d, out2d = x.reshape(-1, x.shape[-1]), out.view(-1, w.shape[0])
        if biases:
            torch.addmm(_stacked(biases), x2d, w.t(), out=out2d)
        else:
            torch.mm(x2d, w.t(), out=out2d)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *weights = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (N, sum rows)
        dx = (g @ _stacked(weights)).view(x.shape) if ctx.needs_input_grad[0] else None
        dws = [None] * ctx.n
        if any(ctx.needs_input_grad[2 : 2 + ctx.n]):
            dws = list((g.t() @ x.reshape(-1, x.shape[-1])).split(ctx.rows))  # one GEMM, sliced per weight
        dbs = list(g.sum(0).split(ctx.rows)) if ctx.has_bias else []
        return (dx, None, *dws, *dbs)


def is_plain_linear(module: nn.Module) -> bool:
    """Whether a fused path may read ``module.weight`` / ``.bias`` in place of calling it: exactly ``nn.Linear``
    (a subclass, e.g. a quantised linear, computes something else) with no forward hooks that a call would run."""
    return type(module) is nn.Linear and not runs_forward_hooks(module)


def runs_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones), which reading its weights skips."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module_hooks._global_forward_hooks
                or _module_hooks._global_forward_pre_hooks)


def all_plain(linears: list[nn.Module]) -> bool:
    return all(is_plain_linear(lin) for lin in linears)


# Packed paths for groups that are not all plain nn.Linear, as (applies(linears), forward(x, linears)). LoRA groups
# (modules/lora_linear.py) register theirs when that module is imported, which happens before any LoraLinear exists;
# it builds on this module, so this one cannot import it.
_GROUP_PATHS: list[tuple[Callable[[list], bool], Callable[[torch.Tensor, list], torch.Tensor]]] = []


def register_group_path(applies: Callable[[list], bool],
                        forward: Callable[[torch.Tensor, list], torch.Tensor]) -> None:
    _GROUP_PATHS.append((applies, forward))


def packed_linear(x: torch.Tensor, linears: list[nn.Linear]) -> torch.Tensor:
    """``cat([l(x) for l in linears], -1)`` computed with one GEMM; output (..., sum of out_features)."""
    if not all_plain(linears):
        for applies, forward in _GROUP_PATHS:
            if applies(linears):
                return forward(x, linears)
    # Under autocast nn.Linear picks the GEMM dtype; a wrapped or hooked projection must run its own forward.
    if torch.is_autocast_enabled(x.device.type) or not all_plain(linears):
        return torch.cat([lin(x) for lin in linears], dim=-1)
    if torch.compiler.is_compiling():
        # The same GEMM on the concatenated weights, which torch.compile traces as plain ops (fake tensors have no
        # storage to alias; dynamo 2.13 also mis-binds the Function's arguments when it inlines it under no_grad).
        biases = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
        return F.linear(x, torch.cat([lin.weight for lin in linears]), biases)
    params = [lin.weight for lin in linears]
    if linears[0].bias is not None:
        params += [lin.bias for lin in linears]
    return _PackedLinear.apply(x, len(linears), *params)


def _owns_storage(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()


def _state_dict_own_copies(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A packed weight leaves ``state_dict()`` as its own tensor (see the module docstring)."""
    for attr in ("weight", "bias"):
        value = state_dict.get(prefix + attr)
        if (value is not None and not isinstance(value, nn.Parameter) and type(value) is torch.Tensor
                and not value.is_meta and not _owns_storage(value)):
            state_dict[prefix + attr] = value.clone()


def pack_linears_(linears: list[nn.Linear]) -> None:
    """Move the weights (and biases) of ``linears`` into one buffer each, in order, keeping Parameter identity.

    Skipped on the meta device and for tensor subclasses (e.g. FSDP's DTensor), where packed_linear concatenates.
    """
    for lin in linears:
        if not getattr(lin, "_liger_own_state_dict", False):
            lin.register_state_dict_post_hook(_state_dict_own_copies)
            lin._liger_own_state_dict = True
    for attr in ("weight", "bias"):
        params = [getattr(lin, attr) for lin in linears]
        if params[0] is None or any(type(p.data) is not torch.Tensor or p.is_meta or p.dtype != params[0].dtype
                                    or p.device != params[0].device for p in params):
            continue
        buffer = torch.empty((sum(p.shape[0] for p in params), *params[0].shape[1:]),
                             dtype=params[0].dtype, device=params[0].device)
        start = 0
        for p in params:
            view = buffer[start : start + p.shape[0]]
            view.copy_(p.data)
            p.data = view
            start += p.shape[0]
