"""Every kernel of the package gives the same bits on every run of the same inputs.

None of them sums in a run-dependent order: no floating-point atomics, partial sums reduced in a fixed order, one
program per output tile. So a difference between two runs is a race (a program reading memory another is still
writing, or a pipelined buffer reused too early), which an error bound catches only when it happens to be large: the
soft-capped attention's dk / dv kernel once passed most seeds of its float64 test while differing on every run
(docs/kernels.md). On the GPU the cases run at model widths, several blocks per dimension with ragged ends; on the CPU
(Triton's interpreter) at a few blocks, so the harness itself runs in CI.
"""

from __future__ import annotations

import functools

import pytest
import torch

from liger_models.kernels import (adamw_step_, add_rms_norm, cross_entropy, decode_attention,
                                  fused_linear_cross_entropy, geglu_packed, layer_norm, qk_norm_rope, rms_norm,
                                  rope_packed, swiglu_packed)
from tests.helpers import BIG_MEMORY, DEVICE, INTERPRETER_ONLY, assert_same_bits_every_run
from tests.kernels.test_rope import cos_sin

ON_GPU = DEVICE == "cuda"
BF16 = torch.bfloat16


def _sizes(gpu: tuple, cpu: tuple) -> tuple:
    return gpu if ON_GPU else cpu


def _leaf(*shape, dtype=BF16, grad=True, scale=1.0, shift=0.0) -> torch.Tensor:
    return (shift + scale * torch.randn(*shape, device=DEVICE)).to(dtype).requires_grad_(grad)


def _labels(n: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    labels[torch.rand(n, device=DEVICE) < 0.1] = -100
    return labels


def _backward(outputs: list[torch.Tensor], seed: int = 99) -> None:
    """Backward from fixed random output gradients (the same on every run: drawn from their own generator)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)


def _norms():
    rows, h = _sizes((2053, 4096), (37, 96))
    x, w = _leaf(rows, h), _leaf(h, scale=0.3, shift=1.0)
    res, lw, lb = _leaf(rows, h), _leaf(h, scale=0.3, shift=1.0), _leaf(h, scale=0.1)
    return dict(x=x, w=w, res=res, lw=lw, lb=lb)


def _run_norms(x, w, res, lw, lb):
    y = rms_norm(x, w, 1e-6)
    z, r = add_rms_norm(x, res, w, 1e-6)
    n = layer_norm(x, lw, lb, 1e-5)
    _backward([y, z, r, n])
    return [y, z, r, n, x.grad, w.grad, res.grad, lw.grad, lb.grad]


def _attention_inputs():
    b, t, hq, hkv, d = _sizes((2, 1025, 32, 8, 128), (1, 37, 4, 2, 16))
    positions = torch.randint(0, 4096, (b, t), device=DEVICE)
    cos, sin = cos_sin(positions, d)
    return dict(qkv=_leaf(b, t, (hq + 2 * hkv) * d), qw=_leaf(d, scale=0.3, shift=1.0),
                kw=_leaf(d, scale=0.3, shift=1.0), cos=cos, sin=sin, heads=(hq, hkv, d))


def _run_rope(qkv, qw, kw, cos, sin, heads):
    q, k, v = rope_packed(qkv * 1, cos, sin, *heads)  # rotates in place: a fresh non-leaf of the leaf
    _backward([q, k, v])
    return [q, k, v, qkv.grad]


def _run_qk_norm_rope(qkv, qw, kw, cos, sin, heads):
    q, k, v = qk_norm_rope(qkv, qw, kw, cos, sin, *heads, 1e-6)
    _backward([q, k, v])
    return [q, k, v, qkv.grad, qw.grad, kw.grad]


def _gated():
    rows, inter = _sizes((2053, 14336), (37, 80))
    return dict(gate_up=_leaf(rows, 2 * inter))


def _run_gated(gate_up, op):
    y = op(gate_up)
    _backward([y])
    return [y, gate_up.grad]


def _logits():
    rows, vocab = _sizes((1031, 128256), (37, 1000))
    return dict(logits=_leaf(rows, vocab, scale=3.0), labels=_labels(rows, vocab))


def _run_cross_entropy(logits, labels):
    out = cross_entropy(logits * 1, labels, label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                        return_token_accuracy=True)
    out.loss.backward()
    return [out.loss, out.token_accuracy, logits.grad]


def _hidden():
    rows, h, vocab = _sizes((2053, 2048, 128256), (37, 64, 1000))
    return dict(hidden=_leaf(rows, h), weight=_leaf(vocab, h, scale=0.02), labels=_labels(rows, vocab))


def _run_linear_ce(hidden, weight, labels, **options):
    out = fused_linear_cross_entropy(hidden, weight, labels, return_target_rank=True, return_token_accuracy=True,
                                     **options)
    out.loss.backward()
    return [out.loss, out.token_accuracy, out.target_rank, hidden.grad, weight.grad]


def _run_linear_ce_filtered(hidden, weight, labels):
    return _run_linear_ce(hidden, weight, labels, grad_filter_eps=1e-5, softcap=30.0)


def _decode():
    b, t, s, hq, hkv, d = _sizes((4, 3, 4097, 32, 8, 128), (2, 3, 45, 4, 2, 16))
    mask = torch.rand(b, 1, t, s, device=DEVICE) < 0.9
    return dict(q=_leaf(b, hq, t, d, grad=False), k=_leaf(b, hkv, s, d, grad=False),
                v=_leaf(b, hkv, s, d, grad=False), mask=mask)


def _run_decode(q, k, v, mask):
    return [decode_attention(q, k, v, mask, q.shape[-1] ** -0.5)]


def _adamw():
    n = _sizes((4097 * 4096 + 3,), (1000,))[0]
    p, g = _leaf(n, dtype=torch.float32, grad=False), _leaf(n, dtype=torch.float32, grad=False)
    m, v = 0.1 * _leaf(n, dtype=torch.float32, grad=False), _leaf(n, dtype=torch.float32, grad=False).square()
    return dict(p=p, g=g, m=m, v=v, step=torch.tensor(7.0, device=DEVICE))


def _run_adamw(p, g, m, v, step):
    adamw_step_(p, g, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    return [p, m, v]


LINEAR_CE = ["loss", "token_accuracy", "target_rank", "dhidden", "dweight"]
CASES = {  # name: (inputs, run, what run returns)
    "rms_norm, add_rms_norm, layer_norm": (_norms, _run_norms, ["rms_norm", "add_rms_norm", "residual sum",
                                                                "layer_norm", "dx", "dw", "dresidual", "dw (layer_norm)",
                                                                "db (layer_norm)"]),
    "rope_packed": (_attention_inputs, _run_rope, ["q", "k", "v", "dqkv"]),
    "qk_norm_rope": (_attention_inputs, _run_qk_norm_rope, ["q", "k", "v", "dqkv", "dq_weight", "dk_weight"]),
    "swiglu_packed": (_gated, functools.partial(_run_gated, op=swiglu_packed), ["out", "dgate_up"]),
    "geglu_packed": (_gated, functools.partial(_run_gated, op=geglu_packed), ["out", "dgate_up"]),
    "cross_entropy (smoothing, z-loss, softcap, accuracy)": (_logits, _run_cross_entropy,
                                                             ["loss", "token_accuracy", "dlogits"]),
    "fused_linear_cross_entropy (ranks, accuracy)": (_hidden, _run_linear_ce, LINEAR_CE),
    "fused_linear_cross_entropy (gradient filter, softcap)": (_hidden, _run_linear_ce_filtered, LINEAR_CE),
    "decode_attention": (_decode, _run_decode, ["out"]),
    "adamw_step_": (_adamw, _run_adamw, ["p", "m", "v"]),
}


def _check_same_bits(case: str) -> None:
    make, run, names = CASES[case]
    assert_same_bits_every_run(run, make(), names)


@INTERPRETER_ONLY
@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_every_run(case):
    """CPU (Triton's interpreter): the harness at a few blocks per dimension."""
    _check_same_bits(case)


@pytest.mark.gpu
@BIG_MEMORY
@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_every_run_on_gpu(case):
    """The compiled kernels at model widths."""
    _check_same_bits(case)


def test_the_check_sees_a_difference():
    """A run whose output changes between runs fails the check."""
    calls = []

    def drifting():
        calls.append(1)
        return [torch.full((3,), float(len(calls)), device=DEVICE)]

    with pytest.raises(AssertionError, match="out: 3 of 3 elements differ between runs"):
        assert_same_bits_every_run(drifting, {}, ["out"])
