"""Tiny HF models of every family, ours loaded from them, and the float64 HF + PEFT reference with our adapters."""

from __future__ import annotations

import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.lora import LoraSettings, add_lora, save_adapter

from ..models.parity import build_hf, causal_lm_loss, float64_reference, max_rel, save_hf

CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "gemma": transformers.GemmaConfig, "phi3": transformers.Phi3Config,
           "qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config,
           "gemma3": transformers.Gemma3TextConfig}
# Families whose tiny HF config needs more than parity.TINY (q/k norms, soft-caps, per-layer-type RoPE).
OVERRIDES = {
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=2.0),
    "gemma3": dict(head_dim=16, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24,
                   sliding_window_pattern=3),
}
# The five original families run every target set; the newer ones the all-linear set.
BASE_FAMILIES = ["gemma", "llama", "mistral", "phi3", "qwen2"]
PACKED = {"phi3"}
TARGET_SETS = {
    "attention": {"split": ["q_proj", "k_proj", "v_proj", "o_proj"], "packed": ["qkv_proj", "o_proj"]},
    "mlp": {"split": ["gate_proj", "up_proj", "down_proj"], "packed": ["gate_up_proj", "down_proj"]},
    "all-linear": {"split": "all-linear", "packed": "all-linear"},
}


def targets(family: str, target_set: str):
    return TARGET_SETS[target_set]["packed" if family in PACKED else "split"]


def pair(family: str, tmp_path, **overrides):
    """(hf fp32 eval, ours fp32 from its checkpoint, checkpoint dir)."""
    hf = build_hf(CONFIGS[family], **{**OVERRIDES.get(family, {}), **overrides})
    directory = save_hf(hf, tmp_path / family)
    return hf, AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32), directory


def with_adapters(model, family: str, target_set: str = "all-linear", **kw):
    settings = LoraSettings(**{"r": 4, "alpha": 8, "targets": targets(family, target_set), "init": False, **kw})
    add_lora(model, settings)
    return model


def peft_float64(hf, ours, tmp_path):
    """HF in float64 (parity.float64_reference) with ours' adapters loaded through PEFT's own loader."""
    import peft

    save_adapter(ours, tmp_path / "adapter")
    truth = peft.PeftModel.from_pretrained(float64_reference(hf), tmp_path / "adapter", is_trainable=True)
    return truth.double()


def batch(vocab: int = 128, rows: int = 2, length: int = 11):
    ids = torch.randint(3, vocab, (rows, length))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def peft_name(ours_name: str) -> str:
    """Our parameter name → PEFT's in-memory one (adapter name "default")."""
    for part in ("lora_A", "lora_B"):
        ours_name = ours_name.replace(f".{part}.weight", f".{part}.default.weight")
    if ours_name.endswith(".lora_magnitude_vector"):  # DoRA
        ours_name += ".default.weight"
    if ours_name.endswith((".lora_embedding_A", ".lora_embedding_B")):  # a ParameterDict entry
        ours_name += ".default"
    return "base_model.model." + ours_name


def assert_matches_float64_peft(ours, truth, names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """One training step's numbers of ours (fp32) against ``truth`` (``peft_float64``: HF + PEFT in float64 with the
    same adapters), both in train mode: logits within 1e-4 of the largest, loss within 1e-5 relative, every trained
    gradient within 1e-4 of its max, no gradient on a frozen parameter. ``names``: our parameter name → truth's,
    where ``peft_name``'s rule does not give it. Returns ours' trained gradients by name."""
    ours.train()
    truth.train()
    ids, labels = batch()
    logits = ours(ids).logits
    exact = truth(input_ids=ids, use_cache=False).logits
    assert (logits.double() - exact).abs().max().item() <= 1e-4 * max(1.0, exact.abs().max().item())
    loss = ours(ids, labels=labels).loss
    ref = causal_lm_loss(exact, labels)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    loss.backward()
    ref.backward()
    truth_params = dict(truth.named_parameters())
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    for name, grad in grads.items():
        assert grad is not None, f"{name}: no gradient"
        if names is not None and name in names:
            ref_name = names[name]
        else:
            ref_name = peft_name(name) if "lora_" in name else "base_model.model." + name
        assert max_rel(grad, truth_params[ref_name].grad) < 1e-4, name
    frozen = [n for n, p in ours.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen parameters got gradients: {frozen[:3]}"
    return grads


def assert_as_close_as_fp32_allows(ours: torch.Tensor, peer: torch.Tensor, exact: torch.Tensor) -> None:
    """``ours`` (fp32 logits) no further from ``exact`` (float64, the same weights) than twice what ``peer`` (another
    fp32 implementation of it) is, or 1e-5 of the largest logit. On some random tiny models a logit is a
    cancellation that fp32 gets to only ~3e-5 (HF + PEFT too), so two fp32 paths are not compared to each other."""
    ours_err = max_rel(ours.double(), exact)
    peer_err = max_rel(peer.double(), exact)
    assert ours_err <= max(2 * peer_err, 1e-5), (ours_err, peer_err)
