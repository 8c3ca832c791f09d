"""Model outputs as dataclasses that PyTorch's pytree sees into.

FSDP2 (``fully_shard``) finds the tensors that carry its pre-backward hook by flattening the root module's output
with ``torch.utils._pytree``; up to torch 2.11 an unregistered dataclass is one opaque leaf there. When the only
gradient-carrying output sits inside such a dataclass and no sharded layer output needs a gradient (Medusa stage 1:
the base runs under no_grad), the hook is never registered, FSDP never reduce-scatters the root group's gradients,
and the heads silently stop training on every rank. Registering each output class as a pytree node fixes that for
every torch version, and lets torch.compile / export see through the outputs too.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch.utils._pytree as pytree

T = TypeVar("T")


def model_output(cls: type[T]) -> type[T]:
    """Class decorator (after ``@dataclass``): register ``cls`` as a pytree node whose children are its fields."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(out):
        return [getattr(out, n) for n in names], None

    def unflatten(values, _context):
        return cls(**dict(zip(names, values)))

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return cls
