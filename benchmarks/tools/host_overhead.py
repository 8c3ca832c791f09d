"""Host time per forward + backward of this project's autograd ops, with and without liger_models/kernels/_launch.py's direct
launch of cached compiled kernels (TUNING.fast_launch; off = Triton's own launcher, which re-binds and re-specialises
every argument on each call). Small shapes, where the host, not the GPU, sets a step's pace.

Host time = wall time of the Python calls with a GPU sleep queued ahead (no launch waits for the device), as in
harness.host_ms_per_call; the GPU time of the same step is printed beside it for scale.

    python benchmarks/tools/host_overhead.py [--out DIR]    (--out defaults to $OUT, as for every bench)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from harness import SLEEP_CYCLES, busy_gpu_ms, host_ms_per_call, parse_args  # noqa: E402


def steps() -> dict:
    from liger_models.kernels.ops.geglu import geglu
    from liger_models.kernels.ops.rms_norm import rms_norm
    from liger_models.kernels.ops.rope import rope
    from liger_models.kernels.ops.swiglu import swiglu_packed

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    gate_up, gate, up = bf16(4096, 8192), bf16(4096, 4096), bf16(4096, 4096)
    x, w = bf16(4096, 4096), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    q_proj, k_proj = bf16(2, 1024, 32 * 64), bf16(2, 1024, 8 * 64)
    pos = torch.arange(1024, device="cuda", dtype=torch.float32)
    freqs = pos[:, None] / 10000 ** (torch.arange(0, 64, 2, device="cuda") / 64)
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos(), emb.sin()
    for t in (gate_up, gate, up, x, w, q_proj, k_proj):
        t.requires_grad_()

    def swiglu_step():
        out = swiglu_packed(gate_up * 1)
        out.backward(out)

    def geglu_step():
        out = geglu(gate, up)
        out.backward(out)

    def rms_step():
        out = rms_norm(x, w, 1e-6)
        out.backward(out)

    def rope_step():
        q, k = (q_proj * 1).view(2, 1024, 32, 64), (k_proj * 1).view(2, 1024, 8, 64)
        q, k = rope(q, k, cos, sin)
        (q.sum() + k.sum()).backward()

    return {"swiglu packed 4096x4096": swiglu_step, "geglu 4096x4096": geglu_step, "rms_norm 4096x4096": rms_step,
            "rope B2 T1024 Hq32 Hkv8 D64": rope_step}


def loss_steps() -> dict:
    """The losses wait for their label check's result inside the call, so a GPU sleep queued ahead would be timed
    too: they run on tiny shapes with the GPU idle instead (a few µs of GPU work per call), where the time per call
    is the host's path plus one check's round trip."""
    from liger_models.kernels.ops.cross_entropy import cross_entropy
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    logits = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1024, (64,), device="cuda")

    def ce_step():
        cross_entropy(logits, labels).backward()

    def flce_step():
        fused_linear_cross_entropy(hidden, weight, labels).backward()

    return {"cross_entropy 64x1024 (GPU idle)": ce_step, "linear-CE 64x256x1024 (GPU idle)": flce_step}


def launch_paths() -> dict:
    """One tiny cached kernel launched five ways: where a launch's host time goes (Triton 3.x internals)."""
    import triton
    import triton.language as tl
    from liger_models.kernels import _launch

    @triton.jit
    def _tiny(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(128, device="cuda")
    meta = dict(BLOCK=128, num_warps=1)
    binary, consts, _, direct_launch = _launch.compiled(_tiny, [x, 128], meta, x.device)
    runner = binary[(1, 1, 1)]
    stream = torch.cuda.current_stream().cuda_stream
    run, function, packed = binary.run, binary.function, binary.packed_metadata
    raw_stream = torch._C._cuda_getCurrentRawStream

    def direct():
        run(1, 1, 1, raw_stream(0), function, packed, None, None, None, x.data_ptr(), 128, *consts)

    return {
        "kernel[grid](...)": lambda: _tiny[(1,)](x, 128, **meta),
        "_launch.launch": lambda: _launch.launch(_tiny, (1,), [x, 128], meta),
        "_launch._spec + _key": lambda: _launch._key(_tiny, 0, _launch._spec([x, 128])[0], meta),
        "_launch._direct": lambda: direct_launch((1,), [x.data_ptr(), 128]),
        "compiled[grid](...)": lambda: binary[(1, 1, 1)](x.data_ptr(), 128, *consts),
        "runner(...), stream given": lambda: runner(x.data_ptr(), 128, *consts, stream=stream),
        "binary.run(...) direct": direct,
        "torch.empty(4096, 4096)": lambda: torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16),
        "autograd.grad of x * 2": _bare_autograd(),
    }


def _bare_autograd():
    x = torch.randn(64, device="cuda", requires_grad=True).clone()
    dy = torch.ones(64, device="cuda")
    return lambda: torch.autograd.grad(x * 2, x, dy)


class _BareRoPE(torch.autograd.Function):
    """The least host work a RoPE Function can do through autograd: the two launches, no checks, no wrapper.
    With LAUNCH False it launches nothing, leaving autograd's own cost for this graph shape."""

    LAUNCH = True

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from liger_models.kernels.ops import rope

        ctx.launch = _BareRoPE.LAUNCH  # the backward runs after the caller has restored LAUNCH
        if ctx.launch:
            rope._launch(q, k, cos, sin, q, k, backward=False)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq, dk):
        from liger_models.kernels.ops import rope

        cos, sin = ctx.saved_tensors
        dq_out = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
        dk_out = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device)
        if ctx.launch:
            rope._launch(dq, dk, cos, sin, dq_out, dk_out, backward=True)
        return dq_out, dk_out, None, None


def _rope_bench_step(fn):
    """bench_rope's headline step (B4 T4096 Hq32 Hkv8 D128): rotate the projection views, autograd.grad with
    SDPA-layout (transposed) incoming gradients."""
    b, t, hq, hkv, d = 4, 4096, 32, 8, 128
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    emb = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((emb, emb), -1)[None]
    cos, sin = emb.cos(), emb.sin()
    q_lin = torch.randn(b, t, hq * d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    k_lin = torch.randn(b, t, hkv * d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    dq = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    dk = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def step():
        q, k = fn(q_lin.view(b, t, hq, d), k_lin.view(b, t, hkv, d), cos, sin)
        return torch.autograd.grad((q, k), (q_lin, k_lin), (dq, dk))

    return step


def _bare_rope_without_launches(*args):
    _BareRoPE.LAUNCH = False
    try:
        return _BareRoPE.apply(*args)
    finally:
        _BareRoPE.LAUNCH = True


def bench_style_steps() -> dict:
    """The headline autograd steps exactly as bench_rms_norm / bench_rope time them (autograd.grad on intermediates),
    and for RoPE the floor under ours: a bare Function with the same launches, and with none."""
    from liger_models.kernels.ops.rms_norm import _RMSNormFunction, rms_norm
    from liger_models.kernels.ops.rope import rope

    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16).requires_grad_().clone()
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    return {
        "rms_norm 16384x4096 autograd.grad": lambda: torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy),
        "  same, Function.apply directly": lambda: torch.autograd.grad(
            _RMSNormFunction.apply(x, None, w, 1e-6, 0.0, False), (x, w), dy),
        "  forward only": lambda: rms_norm(x, w, 1e-6),
        "rope B4 T4096 autograd.grad": _rope_bench_step(rope),
        "  same, bare Function (launches only)": _rope_bench_step(_BareRoPE.apply),
        "  same, bare Function, no launches": _rope_bench_step(_bare_rope_without_launches),
    }


def profile_top(fn, reps: int = 300, top: int = 25) -> str:
    """cProfile of ``fn`` repeated: the host functions by total own time (where a loss call's host time goes)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    args = parse_args(__doc__)
    from liger_models.kernels import _launch
    from liger_models.kernels._tuning import set_tuning

    rows = []
    for name, fn in steps().items():
        row = {"op": name, "gpu_ms": busy_gpu_ms(fn)}
        for fast in (False, True):
            set_tuning(_launch, fast_launch=fast)
            host_ms_per_call(fn, 20, SLEEP_CYCLES)  # warm this path's caches
            row["host_ms_fast" if fast else "host_ms_triton"] = host_ms_per_call(fn, 50, SLEEP_CYCLES * 4)
        rows.append(row)
    set_tuning(_launch, fast_launch=True)
    micro = []
    bench_style = bench_style_steps()
    for name, fn in {**launch_paths(), **bench_style}.items():
        host_ms_per_call(fn, 20, SLEEP_CYCLES)
        micro.append({"path": name, "host_us": 1e3 * host_ms_per_call(fn, 200, SLEEP_CYCLES * 8)})
        if name in bench_style:  # what the kernel benchmarks report for the step: do_bench's median, GPU not kept busy
            micro[-1]["do_bench_us"] = 1e3 * do_bench(fn)
    profiles = {}
    for name, fn in {**steps(), **bench_style_steps()}.items():
        profiles[name] = profile_top(fn, reps=100)
    loss_profiles = {}
    for name, fn in loss_steps().items():
        host_ms_per_call(fn, 20)
        rows.append({"op": name, "gpu_ms": busy_gpu_ms(fn), "host_ms_triton": float("nan"),
                     "host_ms_fast": host_ms_per_call(fn, 200)})
        loss_profiles[name] = profile_top(fn)
    print("| op (fwd+bwd) | GPU ms | host ms, Triton launcher | host ms, direct launch |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['gpu_ms']:.3f} | {r['host_ms_triton']:.3f} | {r['host_ms_fast']:.3f} |")
    print("| host path | µs per call (GPU busy) | do_bench µs |")
    print("|---|---|---|")
    for m in micro:
        print(f"| {m['path']} | {m['host_us']:.1f} | {m.get('do_bench_us', float('nan')):.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows,
                       "launch_paths": micro}, f, indent=1)
        with open(os.path.join(args.out, "host_overhead_loss_profiles.txt"), "w") as f:
            f.write("\n\n".join(f"##### {name}\n{text}" for name, text in loss_profiles.items()))
        with open(os.path.join(args.out, "host_overhead_step_profiles.txt"), "w") as f:
            f.write("\n\n".join(f"##### {name}\n{text}" for name, text in profiles.items()))
    for name in ("cross_entropy 64x1024 (GPU idle)", "rms_norm 16384x4096 autograd.grad"):
        print(f"##### {name}")
        print("\n".join({**loss_profiles, **profiles}[name].splitlines()[:34]))


if __name__ == "__main__":
    main()
