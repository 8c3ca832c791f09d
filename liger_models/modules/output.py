"""Model outputs as dataclasses that PyTorch's pytree sees into and that read like transformers' ``ModelOutput``.

FSDP2 (``fully_shard``) finds the tensors that carry its pre-backward hook by flattening the root module's output
with ``torch.utils._pytree``; up to torch 2.11 an unregistered dataclass is one opaque leaf there. When the only
gradient-carrying output sits inside such a dataclass and no sharded layer output needs a gradient (Medusa stage 1:
the base runs under no_grad), the hook is never registered, FSDP never reduce-scatters the root group's gradients,
and the heads silently stop training on every rank. Registering each output class as a pytree node fixes that for
every torch version, and lets torch.compile / export see through the outputs too.

HF's training loops index outputs instead of reading attributes (``Trainer.compute_loss`` takes ``outputs[0]``, its
prediction step ``outputs[1:]``), so each class also gets ``ModelOutput``'s mapping view, duck-typed (transformers is
not a runtime dependency): only the fields that are not None are its keys, in field order; ``out["loss"]``,
``out[0]`` (the first such field), ``out[1:]``, ``to_tuple()``, ``keys()`` / ``values()`` / ``items()``, ``get``,
``in`` and ``len``; iterating yields the keys, as iterating HF's (an ``OrderedDict``) does. The classes stay plain
dataclasses (not ``dict`` subclasses), so attribute access, ``dataclasses.replace`` and the pytree node are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, TypeVar

import torch.utils._pytree as pytree

T = TypeVar("T")


def _keys(self) -> list[str]:
    """The names of the fields that are set (not None), in field order: ModelOutput's keys."""
    return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]


def _values(self) -> list[Any]:
    return [getattr(self, k) for k in _keys(self)]


def _items(self) -> list[tuple[str, Any]]:
    return [(k, getattr(self, k)) for k in _keys(self)]


def _to_tuple(self) -> tuple:
    return tuple(_values(self))


def _getitem(self, key: str | int | slice) -> Any:
    if isinstance(key, str):
        if key not in _keys(self):  # a field left None is no key, as in ModelOutput
            raise KeyError(key)
        return getattr(self, key)
    return _to_tuple(self)[key]


def _get(self, key: str, default: Any = None) -> Any:
    return getattr(self, key) if key in _keys(self) else default


def _contains(self, key: object) -> bool:
    return key in _keys(self)


def _iter(self) -> Iterator[str]:
    return iter(_keys(self))


def _len(self) -> int:
    return len(_keys(self))


_MAPPING_VIEW = {"keys": _keys, "values": _values, "items": _items, "to_tuple": _to_tuple, "get": _get,
                 "__getitem__": _getitem, "__contains__": _contains, "__iter__": _iter, "__len__": _len}


def model_output(cls: type[T]) -> type[T]:
    """Class decorator (after ``@dataclass``): register ``cls`` as a pytree node whose children are its fields, and
    give it ModelOutput's mapping view (module docstring)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    clash = sorted(set(names) & set(_MAPPING_VIEW))
    if clash:
        raise TypeError(f"{cls.__name__} has fields named {clash}, which the mapping view's methods would shadow")

    def flatten(out):
        return [getattr(out, n) for n in names], None

    def unflatten(values, _context):
        return cls(**dict(zip(names, values)))

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    for name, method in _MAPPING_VIEW.items():
        setattr(cls, name, method)
    return cls
