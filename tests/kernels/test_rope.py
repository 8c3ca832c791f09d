"""RoPE (rotate_half layout, in place on q and k): forward and backward against the float64 reference.

q and k are views of one fused projection output, as the attention layer produces them; incoming gradients
are transposes of (B, H, T, D) tensors, as SDPA hands them back.
"""

import pytest
import torch

from liger_models.kernels.ops import rope as rope_mod
from liger_models.kernels.ops.rope import rope, rope_packed, rope_reference
from tests.helpers import BIG_MEMORY, DEVICE, assert_matches, poison_

DTYPES = [torch.float32, torch.bfloat16]
# (B, T, Hq, Hkv, D, R): Llama-like GQA, partial rotary with a non-power-of-two half (6), a 256-wide head with
# R = 64 (Phi-4-mini-like partial_rotary_factor), MHA with one token, MQA, and GQA with a kv head count that is not
# a power of two (Phi-3-medium's 10 of 40 in small): k's head tile then has masked heads that q's mask would let
# through (a k write past its heads lands in v, which the checks require untouched).
CONFIGS = [(2, 5, 4, 2, 16, 16), (2, 3, 3, 1, 16, 12), (1, 2, 2, 2, 256, 64), (3, 1, 3, 3, 8, 8), (1, 4, 5, 1, 32, 32),
           (2, 3, 6, 3, 8, 8)]


def fused_qkv(b, t, hq, hkv, d, dtype):
    """q, k views of one (B, T, (Hq + 2·Hkv)·D) projection output (an autograd intermediate)."""
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device=DEVICE, requires_grad=True).to(dtype).clone()
    q = qkv[..., : hq * d].view(b, t, hq, d)
    k = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d)
    return qkv, q, k


def cos_sin(position_ids: torch.Tensor, rot: int, theta: float = 10000.0):
    """HF default RoPE tables (B, T, R) in fp32 for explicit position ids."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, device=position_ids.device, dtype=torch.float32) / rot)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def hf_eager(q, k, cos, sin):
    """HF apply_rotary_pos_emb numerics: cos/sin cast to the activation dtype, math in that dtype."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    c, s = cos.to(q.dtype).unsqueeze(2), sin.to(q.dtype).unsqueeze(2)

    def apply(x):
        xr = x[..., :rot]
        return torch.cat((xr * c + torch.cat((-xr[..., half:], xr[..., :half]), dim=-1) * s, x[..., rot:]), dim=-1)

    return apply(q), apply(k)


def sdpa_like_grads(b, t, hq, hkv, d, dtype):
    """Gradients laid out as SDPA returns them: (B, H, T, D) tensors transposed to (B, T, H, D)."""
    dq = torch.randn(b, hq, t, d, device=DEVICE).to(dtype).transpose(1, 2)
    dk = torch.randn(b, hkv, t, d, device=DEVICE).to(dtype).transpose(1, 2)
    return dq, dk


def reference_backward(dq, dk, cos, sin):
    """float64 gradients of the reference rotation for incoming gradients dq (B, T, Hq, D), dk (B, T, Hkv, D)."""
    q64 = torch.zeros(dq.shape, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k64 = torch.zeros(dk.shape, device=DEVICE, dtype=torch.float64, requires_grad=True)
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    return torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))


def check_against_reference(config, dtype, cos_batch):
    b, t, hq, hkv, d, rot = config
    qkv, q, k = fused_qkv(b, t, hq, hkv, d, dtype)
    before = qkv.detach().clone()
    cb = b if cos_batch == "per_batch" else 1
    cos, sin = torch.randn(cb, t, rot, device=DEVICE), torch.randn(cb, t, rot, device=DEVICE)  # arbitrary tables
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))
    qe, ke = (x.detach().clone().requires_grad_() for x in (q, k))
    eq, ek = hf_eager(qe, ke, cos, sin)
    dq_eager, dk_eager = torch.autograd.grad((eq, ek), (qe, ke), (dq, dk))

    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "rope must work in place"
    assert_matches(q_out, rq, eager=eq.detach(), name="q")
    assert_matches(k_out, rk, eager=ek.detach(), name="k")
    now = qkv.detach()
    assert torch.equal(now[..., (hq + hkv) * d :], before[..., (hq + hkv) * d :]), "v must be untouched"
    assert torch.equal(q_out[..., rot:], before[..., : hq * d].view(b, t, hq, d)[..., rot:]), "tail must pass"

    (dqkv,) = torch.autograd.grad((q_out, k_out), qkv, (dq, dk))
    assert_matches(dqkv[..., : hq * d].view(b, t, hq, d), dq_ref, eager=dq_eager, name="dq")
    assert_matches(dqkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d), dk_ref, eager=dk_eager, name="dk")
    assert (dqkv[..., (hq + hkv) * d :] == 0).all()


@pytest.mark.parametrize("cos_batch", ["shared", "per_batch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "B{}T{}Hq{}Hkv{}D{}R{}".format(*c))
def test_matches_reference(config, dtype, cos_batch):
    check_against_reference(config, dtype, cos_batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_sequences_match_separate_documents(dtype):
    """Position ids that restart mark documents: rotating the packed row equals rotating each document alone."""
    lengths = [[3, 4, 2], [1, 6, 2]]
    b, t, hq, hkv, d, rot = 2, 9, 4, 2, 16, 12
    position_ids = torch.tensor([[p for n in row for p in range(n)] for row in lengths], device=DEVICE)
    qkv, q, k = fused_qkv(b, t, hq, hkv, d, dtype)
    q0, k0 = q.detach().clone(), k.detach().clone()
    cos, sin = cos_sin(position_ids, rot)
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    q_out, k_out = rope(q, k, cos, sin)
    (dqkv,) = torch.autograd.grad((q_out, k_out), qkv, (dq, dk))
    for i, row in enumerate(lengths):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            doc_qkv, doc_q, doc_k = fused_qkv(1, n, hq, hkv, d, dtype)
            with torch.no_grad():
                doc_q.copy_(q0[i : i + 1, sl])
                doc_k.copy_(k0[i : i + 1, sl])
            dcos, dsin = cos_sin(torch.arange(n, device=DEVICE)[None], rot)
            dq_out, dk_out = rope(doc_q, doc_k, dcos, dsin)
            (ddoc,) = torch.autograd.grad((dq_out, dk_out), doc_qkv, (dq[i : i + 1, sl], dk[i : i + 1, sl]))
            assert torch.equal(dq_out, q_out[i : i + 1, sl]) and torch.equal(dk_out, k_out[i : i + 1, sl])
            assert torch.equal(ddoc, dqkv[i : i + 1, sl])
            start += n


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_launcher_writes_every_element(dtype):
    """Backward into NaN-poisoned buffers, partial rotary (the pass-through tail is copied), strided grads."""
    b, t, hq, hkv, d, rot = 2, 3, 3, 2, 20, 12
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    cos, sin = torch.randn(b, t, rot, device=DEVICE), torch.randn(b, t, rot, device=DEVICE)
    dst_q = poison_(torch.empty(b, t, hq, d, device=DEVICE, dtype=dtype))
    dst_k = poison_(torch.empty(b, t, hkv, d, device=DEVICE, dtype=dtype))
    rope_mod._launch(dq, dk, cos, sin, dst_q, dst_k, backward=True)
    dq_ref, dk_ref = reference_backward(dq, dk, cos, sin)
    assert_matches(dst_q, dq_ref, name="dq")
    assert_matches(dst_k, dk_ref, name="dk")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_launcher_writes_packed_slices(dtype):
    """The backward writes dq/dk into the q and k slices of a poisoned packed (B, T, W) buffer and nothing else."""
    b, t, hq, hkv, d, rot = 2, 5, 3, 1, 20, 12
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    cos, sin = torch.randn(b, t, rot, device=DEVICE), torch.randn(b, t, rot, device=DEVICE)
    packed = poison_(torch.empty(b, t, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype))
    dst_q = packed[..., : hq * d].unflatten(-1, (hq, d))
    dst_k = packed[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d))
    rope_mod._launch(dq, dk, cos, sin, dst_q, dst_k, backward=True)
    dq_ref, dk_ref = reference_backward(dq, dk, cos, sin)
    assert_matches(dst_q, dq_ref, name="dq")
    assert_matches(dst_k, dk_ref, name="dk")
    assert packed[..., (hq + hkv) * d :].isnan().all(), "the v slice is not the rotation's to write"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "B{}T{}Hq{}Hkv{}D{}R{}".format(*c))
def test_packed_matches_reference(config, dtype):
    """rope_packed on a fused projection output: rotated q/k views, untouched v, and d qkv = [dq' | dk' | dv]."""
    b, t, hq, hkv, d, rot = config
    qkv, q, k = fused_qkv(b, t, hq, hkv, d, dtype)
    before = qkv.detach().clone()
    cos, sin = torch.randn(b, t, rot, device=DEVICE), torch.randn(b, t, rot, device=DEVICE)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    dv = torch.randn(b, hkv, t, d, device=DEVICE).to(dtype).transpose(1, 2)
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))

    q_out, k_out, v_out = rope_packed(qkv, cos, sin, hq, hkv, d)
    assert q_out.shape == (b, t, hq, d) and k_out.shape == (b, t, hkv, d) and v_out.shape == (b, t, hkv, d)
    assert q_out.data_ptr() == qkv.data_ptr(), "q is rotated in place inside qkv"
    assert_matches(q_out, rq, name="q")
    assert_matches(k_out, rk, name="k")
    assert torch.equal(v_out, before[..., (hq + hkv) * d :].unflatten(-1, (hkv, d))), "v must be untouched"
    (dqkv,) = torch.autograd.grad((q_out, k_out, v_out), qkv, (dq, dk, dv))
    assert dqkv.shape == qkv.shape
    assert_matches(dqkv[..., : hq * d].unflatten(-1, (hq, d)), dq_ref, name="dq")
    assert_matches(dqkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d)), dk_ref, name="dk")
    assert torch.equal(dqkv[..., (hq + hkv) * d :].unflatten(-1, (hkv, d)), dv)


def test_packed_unused_outputs_get_zero_gradient():
    """Outputs the loss does not use (autograd passes None) contribute zeros, not garbage."""
    b, t, hq, hkv, d = 2, 3, 4, 2, 8
    qkv, _, _ = fused_qkv(b, t, hq, hkv, d, torch.float32)
    cos, sin = torch.randn(1, t, d, device=DEVICE), torch.randn(1, t, d, device=DEVICE)
    q, k, v = rope_packed(qkv, cos, sin, hq, hkv, d)
    (dqkv,) = torch.autograd.grad(v.sum() * 2, qkv)
    assert (dqkv[..., : (hq + hkv) * d] == 0).all() and (dqkv[..., (hq + hkv) * d :] == 2).all()
    qkv, _, _ = fused_qkv(b, t, hq, hkv, d, torch.float32)
    q, k, v = rope_packed(qkv, cos, sin, hq, hkv, d)
    (dqkv,) = torch.autograd.grad(q.sum(), qkv)
    assert (dqkv[..., hq * d :] == 0).all() and dqkv[..., : hq * d].abs().sum() > 0
    with pytest.raises(ValueError, match="qkv must be"):
        rope_packed(qkv.detach()[..., :-1], cos, sin, hq, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_strided_views(dtype):
    """q, k as (B, T, H, D) views of (B, H, T, D) buffers (head stride T·D, not D), rotated in place; odd T
    also leaves the last token block partly masked."""
    b, t, hq, hkv, d = 2, 7, 3, 2, 16
    bufs = [torch.randn(b, h, t, d, device=DEVICE, requires_grad=True).to(dtype).clone() for h in (hq, hkv)]
    q, k = (x.transpose(1, 2) for x in bufs)
    cos, sin = torch.randn(1, t, d, device=DEVICE), torch.randn(1, t, d, device=DEVICE)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, dtype)
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))
    q_out, k_out = rope(q, k, cos, sin)
    assert_matches(bufs[0].detach().transpose(1, 2), rq, name="q in place")
    assert_matches(bufs[1].detach().transpose(1, 2), rk, name="k in place")
    dq_buf, dk_buf = torch.autograd.grad((q_out, k_out), bufs, (dq, dk))
    assert_matches(dq_buf.transpose(1, 2), dq_ref, name="dq")
    assert_matches(dk_buf.transpose(1, 2), dk_ref, name="dk")


def test_tiling_knobs(tune):
    """Several head tiles per program (q three, k one), several tokens per program with the last block partly
    masked, and the pass-through tail of partial rotary, all in one launch."""
    tune(rope_mod, head_tile=16)  # R = 12 → 8-wide half tiles → 2 heads per tile
    tune(rope_mod, tokens_per_program=4)
    check_against_reference((2, 5, 5, 2, 16, 12), torch.float32, "per_batch")
    check_against_reference((1, 3, 6, 1, 16, 16), torch.bfloat16, "shared")


def test_expanded_gradient():
    """`out.sum().backward()` hands the Function stride-0 gradients."""
    qkv, q, k = fused_qkv(2, 3, 2, 1, 8, torch.float32)
    cos, sin = cos_sin(torch.arange(3, device=DEVICE)[None].expand(2, 3), 8)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    dq_ref, dk_ref = torch.autograd.grad(rq.sum() + rk.sum(), (q64, k64))
    q_out, k_out = rope(q, k, cos, sin)
    (dqkv,) = torch.autograd.grad(q_out.sum() + k_out.sum(), qkv)
    assert_matches(dqkv[..., :16].view(2, 3, 2, 8), dq_ref, name="dq")
    assert_matches(dqkv[..., 16:24].view(2, 3, 1, 8), dk_ref, name="dk")


def test_no_grad_rotates_in_place():
    q, k = torch.randn(2, 4, 3, 16, device=DEVICE), torch.randn(2, 4, 1, 16, device=DEVICE)
    cos, sin = cos_sin(torch.arange(4, device=DEVICE)[None], 16)
    rq, rk = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    with torch.no_grad():
        q_out, k_out = rope(q, k, cos, sin)
    assert q_out is q and k_out is k
    assert_matches(q, rq, name="q")
    assert_matches(k, rk, name="k")


@pytest.mark.parametrize("how", ["slices", "split"])
def test_fused_projection_siblings_keep_their_graph(how):
    """q, k, v from one qkv GEMM: v (used after the in-place rotation) keeps its plain view graph, and the
    weight gradient equals the out-of-place reference's."""
    b, t, hq, hkv, d = 2, 5, 4, 2, 8
    x = torch.randn(b, t, 16, device=DEVICE)
    w = torch.randn((hq + 2 * hkv) * d, 16, device=DEVICE, requires_grad=True)
    cos, sin = cos_sin(torch.arange(t, device=DEVICE)[None], d)

    def weight_grad(fn):
        qkv = x @ w.T
        if how == "split":
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k, v = qkv[..., : hq * d], qkv[..., hq * d : (hq + hkv) * d], qkv[..., (hq + hkv) * d :]
        q, k = fn(q.view(b, t, hq, d), k.view(b, t, hkv, d), cos, sin)
        assert "AsStrided" not in type(v.grad_fn).__name__
        (dw,) = torch.autograd.grad(q.pow(2).sum() + (3 * k).sum() + v.pow(2).sum(), w)
        return dw

    assert_matches(weight_grad(rope), weight_grad(rope_reference).double(), name="dW")


def test_double_backward_raises():
    """create_graph=True: the Triton backward's gradients would carry no grad_fn (d²/dq dq_in silently missing)."""
    b, t, hq, hkv, d = 2, 3, 2, 1, 8
    cos, sin = cos_sin(torch.arange(t, device=DEVICE)[None], d)
    _, q, k = fused_qkv(b, t, hq, hkv, d, torch.float32)
    w = torch.randn((hq + 2 * hkv) * d, 16, device=DEVICE, requires_grad=True)
    x = torch.randn(b, t, 16, device=DEVICE, requires_grad=True)
    q_out, k_out = rope(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(q_out.pow(2).sum() + k_out.sum(), q, create_graph=True)
    q_out, k_out, v = rope_packed(x @ w.T, cos, sin, hq, hkv, d)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(q_out.pow(2).sum() + v.sum(), (x, w), create_graph=True)


def test_reference_path_matches(monkeypatch):
    """CPU tensors outside the interpreter take the PyTorch path through the same autograd.Function."""
    monkeypatch.setattr(rope_mod, "use_triton", lambda *tensors: False)
    check_against_reference((2, 3, 3, 1, 16, 12), torch.bfloat16, "per_batch")
    check_against_reference((1, 4, 2, 2, 8, 8), torch.float32, "shared")


def test_errors():
    _, q, k = fused_qkv(2, 3, 2, 1, 8, torch.float32)
    cos, sin = cos_sin(torch.arange(3, device=DEVICE)[None], 8)
    with pytest.raises(ValueError, match="leaf"):
        rope(torch.randn(2, 3, 2, 8, device=DEVICE, requires_grad=True), k, cos, sin)
    with pytest.raises(TypeError, match="float32"):
        rope(q, k, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(ValueError, match="even"):
        rope(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="head_dim"):
        rope(q, k, *cos_sin(torch.arange(3, device=DEVICE)[None], 10))
    with pytest.raises(ValueError, match="length"):
        rope(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="batch"):
        rope(q, k, cos.expand(3, 3, 8), sin.expand(3, 3, 8))
    with pytest.raises(ValueError, match="unit stride"):
        rope(torch.randn(2, 3, 2, 16, device=DEVICE)[..., ::2], k, cos, sin)
    with pytest.raises(ValueError, match="alias"):
        rope(q, q, cos, sin)
    with pytest.raises(ValueError, match="share"):
        rope(q, torch.randn(2, 4, 1, 8, device=DEVICE), cos, sin)


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_llama3_8b_size():
    b, t, hq, hkv, d = 4, 4096, 32, 8, 128
    qkv, q, k = fused_qkv(b, t, hq, hkv, d, torch.bfloat16)
    qf, kf = q.detach().float(), k.detach().float()
    cos, sin = cos_sin(torch.arange(t, device="cuda")[None].expand(b, t), d, theta=500000.0)
    dq, dk = sdpa_like_grads(b, t, hq, hkv, d, torch.bfloat16)
    q_out, k_out = rope(q, k, cos, sin)
    (dqkv,) = torch.autograd.grad((q_out, k_out), qkv, (dq, dk))
    qf.requires_grad_(), kf.requires_grad_()
    rq, rk = rope_reference(qf, kf, cos, sin)
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (qf, kf), (dq.float(), dk.float()))
    assert_matches(q_out, rq, name="q")
    assert_matches(k_out, rk, name="k")
    assert_matches(dqkv[..., : hq * d].view(b, t, hq, d), dq_ref, name="dq")
    assert_matches(dqkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d), dk_ref, name="dk")


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_above_int32_elements():
    """q of more than 2^31 elements (~4.3 GB bf16), partial rotary: forward and backward checked in chunks."""
    hq, hkv, d, rot = 32, 8, 128, 96
    t = 2**31 // (hq * d) + 8
    q = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    k = torch.randn(1, t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True).clone()
    assert q.numel() > 2**31
    q0, k0 = q.detach().clone(), k.detach().clone()
    cos, sin = cos_sin(torch.arange(t, device="cuda")[None], rot)
    dq, dk = torch.randn_like(q0), torch.randn_like(k0)
    q_out, k_out = rope(q, k, cos, sin)
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
    chunk = 32768
    for s in range(0, t, chunk):
        sl = slice(s, s + chunk)
        qf, kf = q0[:, sl].float().requires_grad_(), k0[:, sl].float().requires_grad_()
        rq, rk = rope_reference(qf, kf, cos[:, sl], sin[:, sl])
        dq_ref, dk_ref = torch.autograd.grad((rq, rk), (qf, kf), (dq[:, sl].float(), dk[:, sl].float()))
        assert_matches(q_out[:, sl], rq, name=f"q tokens {s}+")
        assert_matches(k_out[:, sl], rk, name=f"k tokens {s}+")
        assert_matches(gq[:, sl], dq_ref, name=f"dq tokens {s}+")
        assert_matches(gk[:, sl], dk_ref, name=f"dk tokens {s}+")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_inputs_on_another_device_than_the_current():
    """q, k, cos, sin on cuda:1 while cuda:0 is current: the launches must follow the inputs' device."""
    b, t, hq, hkv, d = 2, 33, 4, 2, 64
    with torch.cuda.device(0):
        qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda:1", requires_grad=True) * 1.0
        cos, sin = cos_sin(torch.arange(t, device="cuda:1")[None].expand(b, t), d)
        before = qkv.detach().clone()
        q, k, v = rope_packed(qkv, cos, sin, hq, hkv, d)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        (dqkv,) = torch.autograd.grad((q, k), qkv, (dq, dk))
        torch.cuda.synchronize(1)
    q0 = before[..., : hq * d].unflatten(-1, (hq, d)).double().requires_grad_()
    k0 = before[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d)).double().requires_grad_()
    rq, rk = rope_reference(q0, k0, cos.double(), sin.double())
    dq_ref, dk_ref = torch.autograd.grad((rq, rk), (q0, k0), (dq.double(), dk.double()))
    assert_matches(q, rq, name="q")
    assert_matches(k, rk, name="k")
    assert_matches(dqkv[..., : hq * d].unflatten(-1, (hq, d)), dq_ref, name="dq")
    assert_matches(dqkv[..., hq * d : (hq + hkv) * d].unflatten(-1, (hkv, d)), dk_ref, name="dk")
