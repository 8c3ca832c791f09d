"""Low-overhead Triton launches: at small sizes a norm's forward + backward is all host time.

Measured on the H200 (benchmarks/tools/tune_norms.py, benchmarks/tools/host_overhead.py): a Triton launch through
``kernel[grid](...)`` costs 14-20 µs of Python, ``triton.cdiv`` / ``triton.next_power_of_2`` ~10 µs per call from
Python (they are Triton constexpr functions), a bare ``autograd.grad`` ~100 µs; the rms_norm forward + backward at
16384×4096 takes 0.18 ms of GPU time. So launchers here use plain-Python integer helpers, cache the SM count, and
launch a compiled kernel themselves once Triton has compiled it (``launch``: 8.5 µs), keyed on exactly what Triton
specialises on, so that a cache hit runs the binary Triton itself would pick.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass

import torch

from triton.runtime.jit import JITFunction

try:
    from triton import knobs
except ImportError:  # a Triton before 3.4: its hooks live elsewhere, so every launch takes Triton's own path
    knobs = None


@dataclass(frozen=True)
class LaunchTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    fast_launch: bool = True  # launch cached compiled kernels directly; False = always through Triton's launcher


TUNING = LaunchTuning()

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

    first = next(iter(inspect.signature(fn).parameters))  # the input may be passed by name (logits=..., x=...)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = args[0] if args else kwargs.get(first)
        # While torch.compile traces, the launches happen later, inside custom ops whose launchers switch themselves.
        if (not isinstance(x, torch.Tensor) or not x.is_cuda or torch.compiler.is_compiling()
                or x.device.index == torch.cuda.current_device()):
            return fn(*args, **kwargs)  # (not a tensor: fn raises its own error about it)
        with torch.cuda.device(x.device):
            return fn(*args, **kwargs)

    return wrapper


def _spec(args: list) -> tuple[list, list]:
    """(what Triton specialises each argument on, the values its compiled launcher takes) in one pass: a tensor's
    dtype and 16-byte alignment (its pointer goes in); an int's ==1, ≡0 mod 16 and 32/64-bit width; the type of a
    float, bool or None (None is a constexpr). Anything else is taken for a tensor: ``type() is`` tests cost a
    third of an isinstance on a Parameter, and this runs for every argument of every launch."""
    spec, values = [], []
    for a in args:
        kind = type(a)
        if kind is int:
            spec.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
        elif kind is float or a is None or kind is bool:
            spec.append(kind)
        else:
            ptr = a.data_ptr()
            spec.append((a.dtype, ptr & 15 == 0))
            a = ptr
        values.append(a)
    return spec, values


def _key(kernel, device_index: int, spec: list, meta: dict) -> tuple:
    """Everything Triton specialises a launch on (constexprs and ``_spec``), and the device the binary is loaded
    on. id(kernel): hashing a JITFunction takes a lock."""
    return (id(kernel), device_index, *meta.values(), *spec)


def compiled(kernel, args: list, meta: dict, device: torch.device) -> tuple:
    """(compiled kernel, constexpr values in signature order, resident programs, direct launcher) for this
    specialisation.

    Compiles without launching on first use (constexpr parameters must follow all runtime ones). Resident
    programs = how many fit on the GPU at once (registers, threads, shared memory per SM), so a persistent grid
    is the same from the first call on. A Triton without these internals gets (None, None, 1 per SM, None).
    """
    key = _key(kernel, device.index, _spec(args)[0], meta)
    info = _COMPILED.get(key)
    if info is None:
        info = _COMPILED[key] = _compile(kernel, args, meta, device)
    return info


def _compile(kernel, args: list, meta: dict, device: torch.device) -> tuple:
    props = torch.cuda.get_device_properties(device)
    threads = 32 * meta["num_warps"]
    try:
        with torch.cuda.device(device):
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
        return None, None, props.multi_processor_count, None
    return binary, consts, max(1, per_sm) * props.multi_processor_count, _direct(binary, consts, device.index)


def _direct(binary, consts: list, device_index: int):
    """A launcher of ``binary`` that skips Triton's per-launch Python (the runner closure, the stream lookup,
    launch-metadata and hook arguments): f(grid, values) calls the compiled C launcher itself. Measured on the
    H200 (benchmarks/tools/host_overhead.py, two runs): ``kernel[grid](...)`` 14-17.5 µs, the compiled runner
    7.5-11.7 µs, this 6.3 µs. None where Triton's internals differ from 3.6's (then the runner is used)."""
    try:
        run, function, packed = binary.run, binary.function, binary.packed_metadata
        c_launch = run.launch
        plain = run.global_scratch_size == 0 and run.profile_scratch_size == 0
        prefix = (function, run.launch_cooperative_grid, run.launch_pdl, None, None, packed, None, None, None)
    except AttributeError:
        return None
    if not plain:  # the kernel needs scratch memory: Triton's launcher allocates it per launch
        return None
    tail = tuple(consts)
    raw_stream = torch._C._cuda_getCurrentRawStream

    def direct(grid: tuple, values: list) -> None:
        c_launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 raw_stream(device_index), *prefix, *values, *tail)

    return direct


def runs_compiled(kernel) -> bool:
    """Whether ``kernel`` runs as compiled GPU code: kernels made under ``TRITON_INTERPRET=1`` are Triton's
    interpreter functions instead (which run a grid's programs one after another, on the CPU)."""
    return type(kernel) is JITFunction


def _hooked() -> bool:
    """Whether a Triton launch hook is installed (a profiler such as proton): then launches take Triton's path."""
    return knobs is None or bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


def launch(kernel, grid: tuple, args: list, meta: dict, kernel_info: tuple | None = None) -> None:
    """``kernel[grid](*args, **meta)``; on CUDA through the cached compiled kernel (``kernel_info`` = ``compiled()``
    of these args when the caller already has it).

    Triton's launcher re-binds and re-specialises every argument on each call; the cached binary gets raw
    pointers (the tensors were checked by Triton on the first, compiling call) and the constexpr values. Kernels
    made under ``TRITON_INTERPRET=1`` are not JITFunctions and always take Triton's path.
    """
    if TUNING.fast_launch and runs_compiled(kernel):
        spec, values = _spec(args)
        info = kernel_info or _COMPILED.get(_key(kernel, args[0].get_device(), spec, meta))
        if info is None:
            info = compiled(kernel, args, meta, args[0].device)
        binary, consts, _, direct = info
        if direct is not None and not _hooked():
            direct(grid, values)
            return
        if binary is not None:
            binary[grid + (1,) * (3 - len(grid))](*values, *consts)
            return
    kernel[grid](*args, **meta)
