"""Low-overhead Triton launches: at small sizes a norm's forward + backward is all host time.

Measured on the H200 machine (benchmarks/tune_norms.py, host section): a Triton launch through
``kernel[grid](...)`` costs ~17-20 µs of Python, ``triton.cdiv`` / ``triton.next_power_of_2`` ~10 µs per call from
Python (they are Triton constexpr functions), a bare ``autograd.grad`` ~100 µs; the rms_norm forward + backward at
16384×4096 takes 0.18 ms of GPU time. So launchers here use plain-Python integer helpers, cache the SM count, and
launch a compiled kernel directly once Triton has compiled it (``launch``), keyed on exactly what Triton
specialises on, so that a cache hit runs the binary Triton itself would pick.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ._dispatch import interpreting

FAST_LAUNCH = True  # launch cached compiled kernels directly; False = always through Triton's launcher
_COMPILED: dict = {}
_SM_COUNT: dict = {}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """Smallest power of two ≥ n (n ≥ 1)."""
    return 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached: the property lookup costs more than a launch); 4 elsewhere."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def on_input_device(fn):
    """Triton launches on the current CUDA device: switch to the input's (a cuda:1 tensor must not run on cuda:0)."""

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        if not x.is_cuda or x.device.index == torch.cuda.current_device():
            return fn(x, *args, **kwargs)
        with torch.cuda.device(x.device):
            return fn(x, *args, **kwargs)

    return wrapper


def _key(kernel, device: torch.device, args: list, meta: dict) -> tuple:
    """Everything Triton specialises a launch on: constexprs; a tensor's dtype and 16-byte alignment; an int's
    ==1, ≡0 mod 16 and 32/64-bit width; None (a constexpr). Floats are not specialised."""
    return (id(kernel), device, *meta.values(),  # id: hashing a JITFunction takes a lock
            *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
              else (a == 1, a % 16 == 0, -(2**31) <= a < 2**31) if type(a) is int else a is None for a in args])


def compiled(kernel, args: list, meta: dict, device: torch.device) -> tuple:
    """(compiled kernel, constexpr values in signature order, resident programs) for this specialisation.

    Compiles without launching on first use (constexpr parameters must follow all runtime ones). Resident
    programs = how many fit on the GPU at once (registers, threads, shared memory per SM), so a persistent grid
    is the same from the first call on. A Triton without these internals gets (None, None, 1 per SM).
    """
    key = _key(kernel, device, args, meta)
    if key not in _COMPILED:
        props = torch.cuda.get_device_properties(device)
        threads = 32 * meta["num_warps"]
        try:
            binary = kernel.warmup(*args, grid=(1,), **meta)
            binary = binary.result() if hasattr(binary, "result") else binary
            binary._init_handles()
            regs = max(8, -(-binary.n_regs // 8) * 8)
            per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads),
                         getattr(props, "max_threads_per_multi_processor", 2048) // threads,
                         getattr(props, "shared_memory_per_multiprocessor", 228 << 10)
                         // (binary.metadata.shared + 1024))  # + the 1 KB the driver reserves per block
            consts = [meta[name] for name in kernel.arg_names[len(args):]]
        except Exception as e:  # noqa: BLE001 - only speed depends on it: plain launches, 1 program per SM
            warnings.warn(f"compiled-kernel query failed ({e!r}); using Triton's launcher, 1 program per SM")
            binary, consts, per_sm = None, None, 1
        _COMPILED[key] = binary, consts, max(1, per_sm) * props.multi_processor_count
    return _COMPILED[key]


def launch(kernel, grid: tuple, args: list, meta: dict, kernel_info: tuple | None = None) -> None:
    """``kernel[grid](*args, **meta)``; on CUDA through the cached compiled kernel (``kernel_info`` = ``compiled()``
    of these args when the caller already has it).

    Triton's launcher re-binds and re-specialises every argument on each call; the cached binary gets raw
    pointers (the tensors were checked by Triton on the first, compiling call) and the constexpr values.
    """
    binary = None
    if FAST_LAUNCH and not interpreting():
        binary, consts, _ = kernel_info or compiled(kernel, args, meta, args[0].device)
    if binary is None:
        kernel[grid](*args, **meta)
        return
    binary[grid + (1,) * (3 - len(grid))](*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args],
                                          *consts)
