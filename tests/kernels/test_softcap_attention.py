"""Soft-capped causal attention (liger_models/kernels/ops/softcap_attention.py): forward and the q, k, v gradients
against the float64 reference with GQA / MQA, a sliding window crossing key blocks, packed documents, a sequence
length and head_dim off the block sizes, one token, and inputs read in place as the strided (B, H, T, D) views of a
packed projection output; bf16 answers to twice the error of HF eager's bf16 op order."""

import pytest
import torch

from liger_models.kernels.ops import softcap_attention as sca
from liger_models.modules.attention import attend_softcapped_math
from tests.helpers import DEVICE, assert_matches, assert_same_bits_every_run, poison_

# (B, T, Hq, Hkv, D, window, documents)
CONFIGS = [
    (2, 37, 4, 2, 24, None, False),  # T and D off the blocks (D padded to 32), GQA
    (1, 70, 2, 2, 16, 9, False),  # a window crossing key blocks, MHA
    (2, 45, 4, 1, 32, None, True),  # packed documents, MQA
    (2, 80, 4, 2, 16, 20, True),  # window and documents
    (1, 1, 2, 1, 16, None, False),  # one token
]


def _packed(b, t, hq, hkv, d, dtype):
    """q, k, v as the model hands them over: (B, H, T, D) views of one (B, T, (Hq + 2 Hkv)·D) tensor."""
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype).requires_grad_()
    return qkv, _heads(qkv, hq, hkv, d)


def _heads(qkv, hq, hkv, d):
    return [x.unflatten(-1, (-1, d)).transpose(1, 2) for x in qkv.split([hq * d, hkv * d, hkv * d], -1)]


def _documents(b, t):
    cuts = torch.rand(b, t, device=DEVICE) < 0.15
    cuts[:, 0] = False
    return cuts.cumsum(-1)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and gradient buffer the op allocates starts as NaN: an element no kernel writes fails."""
    fresh = sca._heads_last
    monkeypatch.setattr(sca, "_heads_last", lambda like, heads: poison_(fresh(like, heads)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
def test_forward_backward_against_float64(config, dtype, poisoned):
    _check(config, dtype)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("window", [None, 1, 16, 17, 40, 200])
@pytest.mark.parametrize("blocks", [(32, 16, 16, 32), (16, 16, 16, 16)])
def test_small_blocks(blocks, window, split, tune, poisoned):
    """Blocks of 16 and 32: many key blocks per query block; windows of one key, on a block boundary, just past one,
    over several blocks and past the sequence, so that every one of the masked / unmasked block ranges is empty in
    some case and not in another; the loops split by mask and not."""
    fwd_m, fwd_n, bwd_m, bwd_n = blocks
    tune(sca, fwd_block_m=fwd_m, fwd_block_n=fwd_n, bwd_block_m=bwd_m, bwd_block_n=bwd_n, split_masked=split)
    _check((2, 83, 4, 2, 16, window, False), torch.float32)


def test_small_blocks_with_documents(tune, poisoned):
    tune(sca, fwd_block_m=32, fwd_block_n=16, bwd_block_m=16, bwd_block_n=32)
    _check((2, 83, 4, 2, 16, 21, True), torch.float32)


GPU_CONFIGS = [(2, 1000, 16, 8, 256, 256, False),  # Gemma-2-9B heads, window 256 of 1000
               (1, 777, 8, 4, 128, None, True),  # Gemma-2-27B's head_dim, documents
               (3, 300, 6, 2, 24, 37, True)]  # head_dim off the blocks, window + documents


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_forward_backward_against_float64_on_gpu(config, dtype, poisoned):
    """The compiled kernels at real head shapes, sequences of several blocks with a ragged end."""
    _check(config, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", GPU_CONFIGS + [(1, 2048, 32, 16, 128, None, False),  # Gemma-2-27B heads
                                                  (1, 2048, 16, 8, 256, None, True)])  # 9B heads, documents
def test_the_compiled_kernels_give_the_same_bits_every_run(config, dtype):
    """No kernel of the op sums in a run-dependent order (no atomics, one program per output tile), so two runs on
    the same inputs agree bit for bit; a difference is a race, which no error bound is sure to catch."""
    b, t, hq, hkv, d, window, with_docs = config
    docs = _documents(b, t) if with_docs else None
    qkv, _ = _packed(b, t, hq, hkv, d, dtype)
    dout = torch.randn(b, t, hq, d, device=DEVICE).to(dtype).transpose(1, 2)

    def run(qkv):
        out = sca.softcap_attention(*_heads(qkv, hq, hkv, d), d**-0.5 * 1.7, 1.5, window, docs)
        out.backward(dout)
        return [out, *qkv.grad.split([hq * d, hkv * d, hkv * d], -1)]

    assert_same_bits_every_run(run, dict(qkv=qkv), ["out", "dq", "dk", "dv"])


def _check(config, dtype):
    b, t, hq, hkv, d, window, with_docs = config
    docs = _documents(b, t) if with_docs else None
    scale, cap = d**-0.5 * 1.7, 1.5  # scores of std ~1.7 against a cap of 1.5: the cap bites
    qkv, (q, k, v) = _packed(b, t, hq, hkv, d, dtype)
    out = sca.softcap_attention(q, k, v, scale, cap, window, docs)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = sca.softcap_attention_reference(*_heads(qkv64, hq, hkv, d), scale, cap, window, docs)
    qkve = qkv.detach().requires_grad_()
    qe, ke, ve = _heads(qkve, hq, hkv, d)
    eager = attend_softcapped_math(qe, ke, ve, sca._allowed(t, window, docs, qe.device), scale, cap)
    assert_matches(out, ref, eager=eager, name="out")
    dout = torch.randn(b, t, hq, d, device=DEVICE).to(dtype).transpose(1, 2)
    out.backward(dout)
    ref.backward(dout.double())
    eager.backward(dout)
    # A gradient is a cancellation of terms as large as the largest gradient (one token: dq = dk = 0 exactly, from
    # p·(dp − δ) with p = 1 and dp = δ), so the fp32 bound is relative to the whole packed gradient.
    floor = qkv64.grad.abs().max().item()
    for name, lo, hi in (("dq", 0, hq * d), ("dk", hq * d, (hq + hkv) * d), ("dv", (hq + hkv) * d, None)):
        assert_matches(qkv.grad[..., lo:hi], qkv64.grad[..., lo:hi], eager=qkve.grad[..., lo:hi], name=name,
                       scale_floor=floor)


def test_the_cap_and_the_mask_matter():
    """The check above can fail: without the cap, or with the window or documents dropped, the output differs."""
    b, t, hq, hkv, d = 2, 40, 2, 1, 16
    _, (q, k, v) = _packed(b, t, hq, hkv, d, torch.float32)
    docs = _documents(b, t)
    docs[:, t // 2:] += 1  # at least one boundary
    full = sca.softcap_attention(q, k, v, 0.5, 1.0, 7, docs)
    for changed in (dict(softcap=100.0), dict(window=None), dict(documents=None)):
        args = dict(softcap=1.0, window=7, documents=docs) | changed
        other = sca.softcap_attention(q, k, v, 0.5, args["softcap"], args["window"], args["documents"])
        assert (other - full).abs().max() > 1e-3, changed


@pytest.mark.parametrize("bad", [dict(softcap=0.0), dict(softcap=float("inf")), dict(window=0),
                                 dict(documents=torch.zeros(3, 5, dtype=torch.long)),
                                 dict(k_heads=3)])
def test_bad_arguments_are_refused(bad):
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, bad.get("k_heads", 2), 5, 8)
    with pytest.raises(ValueError):
        sca.softcap_attention(q, k, k.clone(), 0.3, bad.get("softcap", 2.0), bad.get("window"), bad.get("documents"))
