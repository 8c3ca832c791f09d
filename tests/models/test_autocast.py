"""Mixed precision the AMP way: float32 parameters under ``torch.autocast``, against transformers doing the same."""

import copy

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM

from .parity import build_hf, save_hf


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.GemmaConfig])
def test_autocast_loss_and_float32_residual_stream_like_hf(tmp_path, config_cls, device):
    """Under autocast the GEMMs run in bf16 but, as in HF, the residual stream and the final hidden states keep the
    parameters' float32 (each residual add promotes), and the loss runs the head in autocast's dtype. On CUDA the
    unfused paths run the Triton kernels (autocast turns the fused norm + GEMM Function off)."""
    hf = build_hf(config_cls)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32, device=device)
    truth = copy.deepcopy(hf).double()
    hf = hf.to(device)
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        exact_hidden = truth.model(ids, use_cache=False).last_hidden_state
        exact_loss = truth(ids, labels=ids, use_cache=False).loss.item()
    ids = ids.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        hidden = ours.model(ids)
        hf_hidden = hf.model(ids, use_cache=False).last_hidden_state
        loss = ours(ids, labels=ids).loss
        hf_loss = hf(ids, labels=ids, use_cache=False).loss
    assert hidden.dtype == hf_hidden.dtype == torch.float32
    # The relative L2 error, not the largest element's: that one hangs on single rounding flips (our / HF's ratio
    # reached 2.04 in one GPU run where the L2 ratio stays ≤ 1.09 over 30 seeds on the H200 and the CPU).
    err, hf_err = ((h.detach().double().cpu() - exact_hidden).norm().item() / exact_hidden.norm().item()
                   for h in (hidden, hf_hidden))
    assert err <= 1.25 * hf_err, f"hidden states differ from float64 HF by {err:.3e} (HF under autocast: {hf_err:.3e})"
    loss_err, hf_loss_err = abs(loss.item() - exact_loss), abs(hf_loss.item() - exact_loss)
    assert loss_err <= max(2 * hf_loss_err, 1e-4 * exact_loss), (loss.item(), hf_loss.item(), exact_loss)
    loss.backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
