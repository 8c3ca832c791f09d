"""The config.json files of real Qwen3, Qwen3-MoE and Mixtral checkpoints load and compute exactly as transformers
does (test_real_configs.py's protocol: sizes shrunk, numerics kept; experts 128 → 16 of a smaller width)."""

from __future__ import annotations

import pytest
import torch

from liger_models import AutoLigerForCausalLM

from .parity import check_parity
from .test_real_configs import SEQ, hf_checkpoint, hf_window, position_batches, shrink

QWEN3_06B = {  # Qwen/Qwen3-0.6B: tied, head_dim 128 while hidden / heads = 64
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_8B = {  # Qwen/Qwen3-8B: untied
    **QWEN3_06B, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36, "num_attention_heads": 32,
    "num_hidden_layers": 36, "tie_word_embeddings": False}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: 128 experts, top-8, norm_topk_prob true, head_dim 128 ≠ hidden / heads
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000}

REAL_CONFIGS = {"qwen3-0.6b": QWEN3_06B, "qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B,
                "mixtral-8x7b-v0.1": MIXTRAL_8X7B}


def shrink_moe(real: dict) -> dict:
    cfg = shrink(real)
    if "num_experts" in cfg:
        cfg.update(num_experts=16, moe_intermediate_size=32)
    return cfg


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_config_matches_transformers(tmp_path, name):
    cfg = shrink_moe(REAL_CONFIGS[name])
    hf = hf_checkpoint(cfg, tmp_path / "hf")
    if hasattr(hf, "set_experts_implementation") and "num_experts_per_tok" in cfg:
        hf.set_experts_implementation("eager")  # the float64 reference has no grouped_mm CPU kernel
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert ours.config.model_type == cfg["model_type"]
    assert ours.config.head_dim == (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    assert ours.config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    for i in range(cfg["num_hidden_layers"]):
        assert ours.config.layer_sliding_window(i) == hf_window(hf, i), f"layer {i}"
    check_parity(hf, tmp_path / "hf", SEQ, ours=ours)  # logits, loss and every gradient
    for positions in position_batches(cfg):
        check_parity(hf, tmp_path / "hf", SEQ, batch=positions.shape[0], position_ids=positions, grads=False,
                     ours=ours)
