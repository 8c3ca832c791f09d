"""RoPE forward + backward on q and k (bf16): this project vs eager PyTorch, torch.compile and liger-kernel 0.8.5.

Inputs follow the attention layer: q_proj / k_proj outputs (B, T, H·D), autograd intermediates. This project
rotates their (B, T, H, D) views in place with fp32 cos/sin (1, T, D); the incoming gradients are transposes
of (B, H, T, D) tensors, as SDPA returns them. Eager is HF's apply_rotary_pos_emb on the (B, H, T, D)
transposed views with cos/sin cast to bf16 (as HF does); torch.compile compiles that function; liger-kernel
runs liger_rotary_pos_emb on the same views. Bytes: q and k read and written in the forward, the gradients
read and written in the backward (4·B·T·(Hq + Hkv)·D·2 B) plus the cos/sin reads; floor = bytes / copy
bandwidth measured in the same run.

At these sizes the kernels take less time than the host needs to run one autograd step (Python, autograd
engine, launches), so the step's wall time mostly measures the host (eager aside). Two more numbers separate
the two: "liger-models kernels" times this project's forward + backward launches alone, and for every
provider the GPU time (the host hidden behind a busy stream, harness.busy_gpu_ms) and host time per step are
printed too.

    python benchmarks/bench_rope.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations


import torch
from _bandwidth import report, time_case
from harness import GPU_TIMING, busy_gpu_ms, copy_bandwidth_gbs, host_ms_per_call, parse_args

HEADLINE = (4, 4096, 32, 8, 128)
SWEEP = [(4, t, 32, 8, d) for t in (1024, 4096, 8192) for d in (64, 128)]


def _cos_sin(t: int, d: int, theta: float = 500000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    freqs = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, T, D)
    return emb.cos(), emb.sin()


def hf_rope(q, k, cos, sin):
    """HF apply_rotary_pos_emb: q, k (B, H, T, D); cos, sin (1, T, D) in the activation dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _projections(b: int, t: int, hq: int, hkv: int, d: int):
    """q_proj / k_proj outputs (B, T, H·D) as autograd intermediates."""
    q_lin = torch.randn(b, t, hq * d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    k_lin = torch.randn(b, t, hkv * d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    return q_lin, k_lin


def _grads(b: int, t: int, hq: int, hkv: int, d: int):
    """Incoming gradients as SDPA produces them: contiguous (B, H, T, D)."""
    return (torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16))


def ours_step(b: int, t: int, hq: int, hkv: int, d: int, grads=None):
    """fwd+bwd of this project's rope on (B, T, H, D) views, gradients handed over as (B, T, H, D) transposes."""
    from liger_models.kernels.ops.rope import rope

    cos, sin = _cos_sin(t, d)
    q_lin, k_lin = _projections(b, t, hq, hkv, d)
    dq, dk = _grads(b, t, hq, hkv, d) if grads is None else grads

    def step():
        q, k = rope(q_lin.view(b, t, hq, d), k_lin.view(b, t, hkv, d), cos, sin)
        return torch.autograd.grad((q, k), (q_lin, k_lin), (dq.transpose(1, 2), dk.transpose(1, 2)))

    return step


def kernels_step(b: int, t: int, hq: int, hkv: int, d: int):
    """This project's forward (in place) and backward kernel launches alone, without autograd."""
    from liger_models.kernels.ops import rope as rp

    cos, sin = _cos_sin(t, d)
    q_lin, k_lin = _projections(b, t, hq, hkv, d)
    q, k = q_lin.detach().view(b, t, hq, d), k_lin.detach().view(b, t, hkv, d)
    dq, dk = (g.transpose(1, 2) for g in _grads(b, t, hq, hkv, d))
    dq_out, dk_out = torch.empty_like(q), torch.empty_like(k)

    def step():
        rp._launch(q, k, cos, sin, q, k, backward=False)
        rp._launch(dq, dk, cos, sin, dq_out, dk_out, backward=True)

    return step


def host_us(fn, reps: int = 20) -> float:
    """Host time per call, with ~0.1 s of GPU work queued ahead so that no launch waits for the device."""
    return host_ms_per_call(fn, reps, busy_cycles=200_000_000) * 1e3


def providers_for(b: int, t: int, hq: int, hkv: int, d: int) -> dict:
    cos, sin = _cos_sin(t, d)
    dq_bhtd, dk_bhtd = grads = _grads(b, t, hq, hkv, d)

    def bhtd(fn, cos_, sin_):
        q_lin, k_lin = _projections(b, t, hq, hkv, d)

        def step():
            q = q_lin.view(b, t, hq, d).transpose(1, 2)
            k = k_lin.view(b, t, hkv, d).transpose(1, 2)
            return torch.autograd.grad(fn(q, k, cos_, sin_), (q_lin, k_lin), (dq_bhtd, dk_bhtd))

        return step

    def liger(q, k, cos_, sin_):
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        return liger_rotary_pos_emb(q, k, cos_, sin_)

    cos16, sin16 = cos.bfloat16(), sin.bfloat16()
    return {
        "liger-models": ours_step(b, t, hq, hkv, d, grads),
        "liger-models kernels": kernels_step(b, t, hq, hkv, d),
        "eager": bhtd(hf_rope, cos16, sin16),
        "torch.compile": bhtd(torch.compile(hf_rope, dynamic=False), cos16, sin16),
        "liger-kernel": bhtd(liger, cos16, sin16),
    }


def _measure(case: list, providers: dict, measure, key: str) -> None:
    """Store ``measure(step)`` in each timed result's extra[key] (a diagnostic: a failure is recorded, not fatal)."""
    for r in case:
        if r.ms:
            try:
                r.extra[key] = measure(providers[r.provider])
            except Exception as e:  # noqa: BLE001
                r.extra[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]


def main() -> None:
    args = parse_args(__doc__)
    wanted = set(filter(None, args.providers.split(",")))
    copy_gbs = copy_bandwidth_gbs()
    results = []
    for b, t, hq, hkv, d in [HEADLINE] + ([] if args.quick else [s for s in SWEEP if s != HEADLINE]):
        nbytes = 4 * b * t * (hq + hkv) * d * 2 + 2 * 2 * t * d * 4
        providers = providers_for(b, t, hq, hkv, d)
        case = time_case(f"B{b} T{t} Hq{hq} Hkv{hkv} D{d}", providers, nbytes, copy_gbs,
                         {"B": b, "T": t, "Hq": hq, "Hkv": hkv, "D": d}, wanted)
        _measure(case, providers, host_us, "host_us")
        if not GPU_TIMING:  # else run_case has measured it already
            _measure(case, providers, busy_gpu_ms, "gpu_ms")
        results += case
    print("| case | provider | step ms | GPU ms (kernels) | host us / step |\n|---|---|---|---|---|")
    for r in results:
        if "gpu_ms" in r.extra and "host_us" in r.extra:
            print(f"| {r.case} | {r.provider} | {r.ms:.3f} | {r.extra['gpu_ms']:.3f} | {r.extra['host_us']:.0f} |")
    report("rope", args.out, results, copy_gbs, "eager/compile/liger-kernel get bf16 cos/sin as HF does; ours fp32")


if __name__ == "__main__":
    main()
