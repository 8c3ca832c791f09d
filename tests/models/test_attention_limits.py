"""Batches past SDPA's CUDA limits (very many short rows) are attended in chunks of the batch, never a CUDA fault
(liger_models/modules/attention.py, ``_sdpa``). The chunking is exercised on the CPU by declaring the CPU limited;
the GPU test runs the shapes that crashed (Llama-8B heads, B=8192 and 65536 rows of one token) forward and backward.
Compiled flex_attention stays compiled past dynamo's recompile limit (GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from liger_models import LigerLlamaForCausalLM, LlamaConfig
from liger_models.modules import attention
from liger_models.modules.attention import AttentionMask, attend, sdpa_rows_per_call

HQ, HKV, D = 32, 8, 128  # Llama-3-8B's attention heads


def test_rows_per_call_at_llama_8b_heads():
    assert sdpa_rows_per_call(HQ, 1, D, backward=True) == 4096  # B=8192 × T=1 crashed: two calls now
    assert sdpa_rows_per_call(HQ, 1, D, backward=False) == 65535  # B=65536 was `invalid argument`
    assert sdpa_rows_per_call(HQ, 8192, D, backward=True) == 64
    assert sdpa_rows_per_call(HQ, 1024, D, backward=True) >= 64  # training batches take one call
    assert sdpa_rows_per_call(HQ, 129, 16, backward=True) == 2**31 // (HQ * 256 * 32)  # both paddings count


@pytest.fixture
def limited_cpu(monkeypatch):
    """The CPU with SDPA's CUDA limits, shrunk to test shapes: 3 rows per call."""
    monkeypatch.setattr(attention, "_SDPA_LIMITED", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "SDPA_MAX_ROWS", 3)


def _qkv(B: int, T: int, S: int, dtype=torch.float32):
    q = torch.randn(B, 4, T, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(B, 2, S, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(B, 2, S, 16, dtype=dtype, requires_grad=True)
    return q, k, v


def _forward_backward(fn, q, k, v):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


@pytest.mark.parametrize("case", ["causal", "row masks", "shared mask", "one new token"])
def test_chunked_equals_one_call(limited_cpu, case):
    B, T = 8, 5
    S = T + 3 if case == "one new token" else T
    q, k, v = _qkv(B, 1 if case == "one new token" else T, S)
    mask = {"row masks": torch.rand(B, 1, T, S) > 0.3, "shared mask": torch.rand(1, 1, T, S) > 0.3}.get(case)
    if mask is not None:
        mask |= torch.eye(T, S, dtype=torch.bool)  # no empty row
    kwargs = {"is_causal": True} if case == "causal" else {"attn_mask": mask}

    def one_call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)

    def chunked(q, k, v):
        return attention._sdpa(q, k, v, enable_gqa=True, **kwargs)

    calls = []
    original = F.scaled_dot_product_attention
    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", counted)
        out, grads = _forward_backward(chunked, q, k, v)
    assert calls == [3, 3, 2]
    ref_out, ref_grads = _forward_backward(one_call, q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-6)


def test_a_model_step_in_chunks_equals_one_call(monkeypatch):
    config = LlamaConfig.tiny(vocab_size=64)
    model = LigerLlamaForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (7, 6))
    positions = torch.tensor([0, 1, 2, 0, 1, 2]).expand(7, 6)  # two documents per row: the masked path too

    def step(**kw):
        model.zero_grad()
        loss = model(ids, labels=ids, **kw).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    reference = [step(), step(position_ids=positions)]
    monkeypatch.setattr(attention, "_SDPA_LIMITED", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "SDPA_MAX_ROWS", 2)
    for (loss, grads), (ref_loss, ref_grads) in zip([step(), step(position_ids=positions)], reference):
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
        for g, ref in zip(grads, ref_grads):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def test_one_row_past_flash_backwards_range_is_refused(monkeypatch):
    monkeypatch.setattr(attention, "_SDPA_LIMITED", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "FLASH_BACKWARD_ELEMENTS", 4 * 128 * 32 - 1)  # one row of 4 heads × T ≤ 128
    q, k, v = _qkv(2, 5, 5, torch.bfloat16)
    with pytest.raises(ValueError, match=r"one sequence of 5 tokens × 4 heads × head_dim 16 is past "
                                         r"FlashAttention's 32-bit backward index range"):
        attention._sdpa(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad():  # forward only: no backward index
        attention._sdpa(q, k, v, is_causal=True, enable_gqa=True)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    attention._sdpa(q, k, v, attn_mask=mask, enable_gqa=True)  # with a mask SDPA cannot take FlashAttention


@pytest.mark.gpu
@pytest.mark.parametrize("B", [8192, 65536])
def test_many_one_token_rows_at_llama_8b_heads_on_cuda(B):
    """Each row attends to its one token: the output is v (per query head's kv head) and only v gets a gradient."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = rand(B, HQ, 1, D), rand(B, HKV, 1, D), rand(B, HKV, 1, D)
    mask = AttentionMask(1, 0, None, q.device)
    out = attend(q, k, v, mask, None, D**-0.5)
    grad = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out.backward(grad)
    torch.cuda.synchronize()
    groups = HQ // HKV
    torch.testing.assert_close(out, v.detach().repeat_interleave(groups, dim=1), rtol=0, atol=0)
    expected_dv = grad.float().view(B, HKV, groups, 1, D).sum(2).to(torch.bfloat16)
    torch.testing.assert_close(v.grad, expected_dv, rtol=1.6e-2, atol=1e-2)
    # dq and dk are 0 in exact arithmetic (one key: the softmax is constant). The backward forms dP − rowsum(dO∘O)
    # from the same D products summed in two orders in fp32; each sum is off by at most D·2⁻²⁴·Σ|dO∘v|, their
    # difference by twice that, and the bound allows twice again for the bf16 dS. Times |k| (|q|) · scale, and for
    # dk summed over a kv head's query group. A wrong row or an index past the limit is of the gradient's own order.
    cancel = D * 2.0**-22 * (grad.float().abs() * v.detach().float().repeat_interleave(groups, 1).abs()).sum(-1).max()
    scale = D**-0.5
    q_bound = (cancel * k.detach().float().abs().max() * scale).item()
    k_bound = (groups * cancel * q.detach().float().abs().max() * scale).item()
    assert q.grad.isfinite().all() and k.grad.isfinite().all()
    assert q.grad.float().abs().max().item() <= q_bound, (q.grad.abs().max().item(), q_bound)
    assert k.grad.float().abs().max().item() <= k_bound, (k.grad.abs().max().item(), k_bound)


@pytest.mark.gpu
def test_flex_attention_stays_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Each distinct flex call is a compile of its own and dynamo counts them per process; past its recompile_limit
    it would run flex_attention uncompiled, materialising the T×T scores. With the limit at 1, four distinct calls
    (head_dim, dtype, window, documents) each stay fused: peak memory far below one score tensor, the output that of
    SDPA with the boolean mask. Below our own limit a fallback is an error, never a silent unfused call."""
    # not monkeypatch: its undo deletes a config module's entry
    with torch._dynamo.config.patch(recompile_limit=1):
        B, H, T = 1, 8, 4096
        scores_bytes = B * H * T * T * 4
        positions = torch.arange(T, device="cuda")
        docs = (positions >= 1000).long() + (positions >= 3000).long()
        cases = [(64, torch.bfloat16, 256, None), (128, torch.bfloat16, 256, None),
                 (64, torch.float16, None, docs[None]), (64, torch.bfloat16, 512, docs[None])]
        for d, dtype, window, documents in cases:
            q, k, v = (torch.randn(B, H, T, d, device="cuda", dtype=dtype) for _ in range(3))
            mask = AttentionMask(T, 0, documents, q.device)
            mask.block(window)  # built before the measurement: the BlockMask's construction is not the attention
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.no_grad():
                out = attend(q, k, v, mask, window, d**-0.5)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
            assert extra < scores_bytes / 8, (d, dtype, window, extra)
            with torch.no_grad():
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.boolean(window), scale=d**-0.5)
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)

        monkeypatch.setattr(attention, "FLEX_RECOMPILE_LIMIT", 1)
        q, k, v = (torch.randn(B, H, T, 32, device="cuda") for _ in range(3))  # fp32: a dtype no call above compiled
        with pytest.raises(Exception) as failure, torch.no_grad():
            attend(q, k, v, AttentionMask(T, 0, None, q.device), 128, 32**-0.5)
        assert "RecompileLimit" in type(failure.value).__name__, failure.value
