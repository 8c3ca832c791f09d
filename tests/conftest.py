"""Test configuration: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before anything imports triton, so it is set here, at collection time.
GPU-only tests carry ``@pytest.mark.gpu`` and are deselected by default (``pytest -m gpu`` runs them).
"""

import hashlib
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests' tensors are tiny: one thread avoids OpenMP spin contention, which made the suite 2-3x slower
    # on the 2-core CI machine.
    torch.set_num_threads(1)

# Loaded once this module has set TRITON_INTERPRET, as everything that imports triton must be.
pytest_plugins = ["tests.training_fixtures"]

# peft and transformers import bitsandbytes (a test dependency) when it is installed, and its first import on a CPU
# with AVX-512 BF16 asks the Hub for a kernel. Imported first, here, the network-free way the package imports it,
# it is already loaded when they ask: no test touches the network. (Imported here: it imports triton.)
from tests.lora.bnb import import_bnb  # noqa: E402

import_bnb()

# LIGER_TUNE="module.field=value,...": the whole run with those kernel settings, as the benchmarks take them (a GPU
# run of the paths a setting switches off by default: benchmarks/device_session.sh moe-unfused). Tests that force a
# path with the `tune` fixture still do; it restores these settings after them.
if os.environ.get("LIGER_TUNE"):
    from liger_models.kernels._tuning import set_tuning_from

    set_tuning_from(os.environ["LIGER_TUNE"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Fresh random inputs every run, replayable: every test and every shared (session / module) fixture draws from a
# seed derived from this one and its own name, so LIGER_TEST_SEED=<printed value> rebuilds the same random models
# in shared fixtures too (they are built before any test's own seeding, and once drew from an unseeded generator).
SESSION_SEED = int(os.environ.get("LIGER_TEST_SEED", random.SystemRandom().randrange(2**31)))


def derived_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SESSION_SEED}:{name}".encode()).digest()[:4], "little") & 0x7FFFFFFF


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope != "function":
        torch.manual_seed(derived_seed(f"fixture {fixturedef.baseid} {fixturedef.argname}"))
    yield


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """The seed is printed (shown on failure); ``LIGER_TEST_SEED`` replays it."""
    print(f"LIGER_TEST_SEED={SESSION_SEED}")
    torch.manual_seed(derived_seed(request.node.nodeid))
    yield


@pytest.fixture(autouse=True)
def _release_gpu_cache(request):
    """Hand a GPU test's cached blocks back to the driver, so parallel workers (pytest -n) do not each sit on the
    largest pool they ever needed."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def interpreter_rounds_bf16(monkeypatch):
    """Make Triton's CPU interpreter round fp32 → bf16 casts to nearest-even, as the GPU does.

    Triton 3.6's interpreter truncates fp32 → bf16 (its ``_convert_float`` drops the low mantissa bits, even when
    asked for round-to-nearest), so every bf16 kernel output under ``TRITON_INTERPRET=1`` would carry up to one
    extra bf16 ulp of error that the compiled kernel does not have. This swaps in a correct conversion.
    """
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = getattr(interpreter, "_convert_float", None)
    if truncating is None:  # a Triton whose interpreter converts differently: nothing to correct here
        yield
        return

    def convert(data, src, dst, rounding_mode):
        rtz = rounding_mode is not None and "RTZ" in str(rounding_mode)
        if src == tl.float32 and dst == tl.bfloat16 and not rtz:
            f32 = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return truncating(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    yield


def _memoise_interpreter_lang_patching() -> None:
    """Triton's interpreter, at every kernel launch, finds again which members of triton.language (and its tensor
    and math modules) are builtins, with inspect.getmembers, and wraps each in a fresh lambda before setting it:
    about 1 ms a launch, a quarter of the time of an interpreted training-step test (cProfile, Triton 3.9). The
    members are fixed and each wrapper depends on its member alone, so the wrappers are made once per module, by
    the interpreter's own _patch_attr, and set at each launch into the launch's scope exactly as it would set them
    (restored at the launch's end as before); a device function's call inside a launch, where every builtin is
    wrapped already and the interpreter wraps none, sets nothing. A Triton whose interpreter lacks these functions
    is left alone."""
    from triton.runtime import interpreter

    make_wrapper = getattr(interpreter, "_patch_attr", None)
    if make_wrapper is None or not hasattr(interpreter, "_patch_builtin"):
        return
    import inspect
    import types

    import triton.language as tl

    wrappers = {}  # (module or class, builder) → [(name, wrapper)]

    def patch_builtin(pkg, builder, scope):
        changes = wrappers.get((pkg, builder))
        if changes is None:
            changes = wrappers[pkg, builder] = []
            recorder = types.SimpleNamespace(set_attr=lambda obj, name, value: changes.append((name, value)))
            for name, member in inspect.getmembers(pkg):
                if tl.core.is_builtin(member):
                    make_wrapper(pkg, name, member, builder, recorder)
        if changes and getattr(pkg, changes[0][0]) is changes[0][1]:
            return  # a device function called inside a launch: patched already, where the interpreter finds no
            # builtin left to wrap either
        for name, wrapper in changes:
            scope.set_attr(pkg, name, wrapper)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _memoise_interpreter_lang_patching()


@pytest.fixture
def tune():
    """``tune(module, field=value, ...)``: a kernel module's TUNING with those settings until the test ends
    (liger_models/kernels/_tuning.py: the one way tests force a kernel path)."""
    import contextlib

    from liger_models.kernels._tuning import tuned

    with contextlib.ExitStack() as stack:
        yield lambda module, **changes: stack.enter_context(tuned(module, **changes))
