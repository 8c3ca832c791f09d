"""Mixed precision the AMP way: float32 parameters under ``torch.autocast``, against transformers doing the same."""

import copy

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM

from .parity import TINY_MOE, build_hf, save_hf


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


NATIVE = {"llama": (transformers.LlamaConfig, {}), "gemma2": (transformers.Gemma2Config, dict(
    head_dim=16, sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=2.0)),
    "qwen3_moe": (TINY_MOE["qwen3_moe"][0], dict(TINY_MOE["qwen3_moe"][1], output_router_logits=True))}


@pytest.mark.parametrize("family", list(NATIVE))
def test_a_bf16_model_under_bf16_autocast_runs_its_fused_paths_bit_for_bit(tmp_path, family, monkeypatch):
    """HF Trainer's and TRL's bf16=True (TRL's default) run the forward under bf16 autocast. On a bf16 model that
    changes no precision, but it turned every fused path to its unfused fallback (the LoRA core to the composed
    plain ops): the forward now runs without it (``native_precision``), so loss and every gradient, native adapters
    on every linear and lm_head included, equal the run without autocast bit for bit, and no adapter takes the
    composed path. A PEFT-wrapped model keeps autocast: its adapter products then run in bf16, as on HF's."""
    import peft

    from liger_models.lora import LoraSettings, add_lora
    from liger_models.modules.lora_linear import LoraLinear

    config, overrides = NATIVE[family]
    directory = save_hf(build_hf(config, **overrides), tmp_path / "base")
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False, targets=["q_proj", "v_proj", "o_proj", "lm_head"]
                                if family == "qwen3_moe" else "all-linear"))
    ours.train()
    composed = []
    original = LoraLinear.composed
    monkeypatch.setattr(LoraLinear, "composed", lambda self, x: composed.append(1) or original(self, x))
    ids = torch.randint(3, 128, (2, 12))
    runs = []
    for enabled in (False, True):
        ours.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}))
    assert not composed
    (plain_loss, plain_grads), (autocast_loss, autocast_grads) = runs
    assert torch.equal(plain_loss, autocast_loss)
    assert plain_grads.keys() == autocast_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        assert torch.equal(grad, autocast_grads[name]), name

    wrapped = peft.get_peft_model(AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.bfloat16),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    seen = []
    hook = wrapped.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(input_ids=ids, labels=ids)
    hook.remove()
    assert seen == [torch.bfloat16]  # fp32 adapter weights, run in autocast's dtype
