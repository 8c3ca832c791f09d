"""Renames without breaking callers: the old name keeps working for one minor version, with a FutureWarning that
names its replacement and the version that removes it (docs/api.md, "Stability")."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable


def deprecated(replacement: str, since: str, removal: str) -> Callable:
    """Decorator for a function (or method) kept under an old name: each call warns once per call site."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def warned(*args, **kwargs):
            warnings.warn(f"{fn.__qualname__} is deprecated since {since} and will be removed in {removal}: use "
                          f"{replacement}", FutureWarning, stacklevel=2)
            return fn(*args, **kwargs)

        return warned

    return wrap


def moved_names(module_name: str, moves: dict[str, tuple[str, Any]], since: str, removal: str) -> Callable:
    """A module ``__getattr__`` serving names that moved elsewhere: ``moves`` maps an old name to (its new place as
    text, the object). Unknown names raise AttributeError as usual."""

    def __getattr__(name: str):
        if name not in moves:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        place, obj = moves[name]
        warnings.warn(f"{module_name}.{name} moved to {place} in {since}; the old name goes in {removal}",
                      FutureWarning, stacklevel=2)
        return obj

    return __getattr__
