"""The deprecation helpers warn with the replacement and the removal version, and keep the old name working."""

import types

import pytest

from liger_models.deprecation import deprecated, moved_names


def test_deprecated_function_warns_and_still_works():
    @deprecated("new_fn", since="0.2", removal="0.3")
    def old_fn(x, *, scale=2):
        return x * scale

    with pytest.warns(FutureWarning, match=r"old_fn is deprecated since 0.2 and will be removed in 0.3: use new_fn"):
        assert old_fn(3, scale=4) == 12


def test_moved_name_warns_and_resolves():
    module = types.ModuleType("pkg.old")
    module.__getattr__ = moved_names("pkg.old", {"Thing": ("pkg.new.Thing", int)}, since="0.2", removal="0.3")
    with pytest.warns(FutureWarning, match=r"pkg.old.Thing moved to pkg.new.Thing in 0.2; the old name goes in 0.3"):
        assert module.Thing is int
    with pytest.raises(AttributeError, match="has no attribute 'Other'"):
        module.Other  # noqa: B018
