"""The config.json files of real Hugging Face checkpoints load and compute exactly as transformers does.

Each entry below is the config.json of a popular checkpoint, key for key as the Hub serves it (v4-era spellings:
``torch_dtype``, ``rope_scaling`` with ``type`` or ``rope_type``, top-level ``rope_theta``), minus keys with no
effect on numerics or layout (``_name_or_path``, ``auto_map``, ``transformers_version``, ``use_cache``, dropouts).
Only sizes are shrunk (``shrink``): layers, vocabulary, MLP width and head counts. head_dim, rope_theta, every
rope_scaling block, original/max position lengths, windows, biases, activations and ties keep their real values;
far positions are reached through position_ids instead of long inputs, so rope scaling switches are exercised at
the checkpoints' real thresholds.

transformers builds the model from the very same config.json; its random weights are saved with save_pretrained,
the real config.json is written back over the one it re-serialised, and our loader reads that directory.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from liger_models import (AutoLigerForCausalLM, GemmaConfig, LigerGemmaForCausalLM, LigerLlamaForCausalLM,
                          LigerPhi3ForCausalLM, LlamaConfig, Phi3Config)

from .parity import check_parity, perturb_norms


def _factors(start: float, stop: float, n: int = 48) -> list[float]:
    """Monotonic per-dimension longrope factors shaped like Microsoft's (48 entries for head_dim 96); the exact
    published values do not matter for parity, their count, order and spread do."""
    return [start * (stop / start) ** (i / (n - 1)) for i in range(n)]


LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 32000}
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
LLAMA31_8B_INSTRUCT = {  # meta-llama/Llama-3.1-8B-Instruct (eos list; the base model has eos 128001)
    **LLAMA3_8B, "eos_token_id": [128001, 128008, 128009], "max_position_embeddings": 131072, "mlp_bias": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
LLAMA32_1B = {  # meta-llama/Llama-3.2-1B
    **LLAMA31_8B_INSTRUCT, "eos_token_id": 128001, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
LLAMA32_3B_INSTRUCT = {  # meta-llama/Llama-3.2-3B-Instruct
    **LLAMA32_1B, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_size": 3072,
    "num_attention_heads": 24, "num_hidden_layers": 28}
CODELLAMA_7B = {  # codellama/CodeLlama-7b-hf (rope_theta written as an integer)
    **LLAMA2_7B, "max_position_embeddings": 16384, "rope_theta": 1000000, "torch_dtype": "bfloat16",
    "vocab_size": 32016}
TINYLLAMA = {  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    **LLAMA2_7B, "attention_bias": False, "hidden_size": 2048, "intermediate_size": 5632,
    "max_position_embeddings": 2048, "num_hidden_layers": 22, "num_key_value_heads": 4, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16"}
DEEPSEEK_CODER_67B_INSTRUCT = {  # deepseek-ai/deepseek-coder-6.7b-instruct: linear rope scaling, integer theta
    **LLAMA2_7B, "bos_token_id": 32013, "eos_token_id": 32021, "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-06, "rope_scaling": {"factor": 4.0, "type": "linear"}, "rope_theta": 100000,
    "torch_dtype": "bfloat16", "vocab_size": 32256}
LLAMA2_7B_DYNAMIC = {  # Llama-2-7b with the dynamic-NTK block transformers' docs give (as long-context fine-tunes use)
    **LLAMA2_7B, "rope_scaling": {"factor": 2.0, "type": "dynamic"}}

MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000}
MISTRAL_7B_V03 = {  # mistralai/Mistral-7B-v0.3
    **MISTRAL_7B_V01, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768}
MISTRAL_NEMO = {  # mistralai/Mistral-Nemo-Base-2407: head_dim 128 while hidden / heads = 160
    **MISTRAL_7B_V03, "head_dim": 128, "hidden_size": 5120, "max_position_embeddings": 1024000,
    "num_hidden_layers": 40, "vocab_size": 131072}
MISTRAL_7B_V03_HEAD_DIM_NULL = {  # Mistral-7B-v0.3 as transformers 4.48 re-saved it: "head_dim": null
    **MISTRAL_7B_V03, "head_dim": None}

QWEN2_05B = {  # Qwen/Qwen2-0.5B (tied)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 131072, "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
QWEN2_7B = {  # Qwen/Qwen2-7B
    **QWEN2_05B, "hidden_size": 3584, "intermediate_size": 18944, "max_window_layers": 28, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 152064}
QWEN25_7B = {**QWEN2_7B, "use_mrope": False}  # Qwen/Qwen2.5-7B
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B: max_window_layers < layers, but use_sliding_window is off
    **QWEN2_05B, "max_position_embeddings": 32768, "max_window_layers": 21, "sliding_window": 32768,
    "use_mrope": False}
QWEN25_7B_INSTRUCT = {  # Qwen/Qwen2.5-7B-Instruct
    **QWEN2_7B, "eos_token_id": 151645, "max_position_embeddings": 32768}
QWEN25_7B_INSTRUCT_YARN = {  # the same with the rope_scaling block its model card says to add for 128k context
    **QWEN25_7B_INSTRUCT,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
QWEN25_CODER_7B_INSTRUCT = {  # Qwen/Qwen2.5-Coder-7B-Instruct
    **QWEN25_7B_INSTRUCT, "max_window_layers": 28, "sliding_window": 131072}

GEMMA_2B = {  # google/gemma-2b: "gelu" means the tanh approximation for this family; MQA; head_dim 256
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 16384, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000}
GEMMA_7B = {  # google/gemma-7b: 16 heads of 256 while hidden is 3072
    **GEMMA_2B, "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 16}
GEMMA_11_2B_IT = {  # google/gemma-1.1-2b-it: both activation keys
    **GEMMA_2B, "hidden_activation": "gelu_pytorch_tanh"}
CODEGEMMA_7B = {  # google/codegemma-7b
    **GEMMA_7B, "hidden_activation": "gelu_pytorch_tanh"}

GEMMA2_2B = {  # google/gemma-2-2b: four norms per layer, softcaps 50 / 30, windows on even layers
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "use_cache": True,
    "vocab_size": 256000}
GEMMA2_9B = {  # google/gemma-2-9b
    **GEMMA2_2B, "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8}
GEMMA2_27B = {  # google/gemma-2-27b: head_dim 128 and query_pre_attn_scalar 144 (not head_dim)
    **GEMMA2_2B, "head_dim": 128, "hidden_size": 4608, "intermediate_size": 36864, "num_attention_heads": 32,
    "num_hidden_layers": 46, "num_key_value_heads": 16, "query_pre_attn_scalar": 144}
GEMMA3_1B = {  # google/gemma-3-1b-it: text-only Gemma 3, v4-style rope keys, pattern 6, window 512
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144}
GEMMA3_270M = {  # google/gemma-3-270m: explicit layer_types (and the _-prefixed pattern key HF ignores)
    **{k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"},
    "_sliding_window_pattern": 6, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "use_bidirectional_attention": False,
    "eos_token_id": 1}

PHI3_MINI_4K = {  # microsoft/Phi-3-mini-4k-instruct
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064}
PHI3_MINI_128K = {  # microsoft/Phi-3-mini-128k-instruct (as first published: type "su")
    **PHI3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
    "rope_scaling": {"long_factor": _factors(1.03, 64.0), "short_factor": _factors(1.1, 2.3), "type": "su"}}
PHI3_MINI_128K_LONGROPE = {  # microsoft/Phi-3-mini-128k-instruct after the su → longrope rename
    **PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": "longrope"}}
PHI35_MINI = {  # microsoft/Phi-3.5-mini-instruct
    **PHI3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
    "rope_scaling": {"long_factor": _factors(1.08, 60.0), "short_factor": _factors(1.0, 2.8), "type": "longrope"}}
PHI3_MEDIUM_4K = {  # microsoft/Phi-3-medium-4k-instruct: GQA 40 / 10 heads of 128
    **PHI3_MINI_4K, "hidden_size": 5120, "intermediate_size": 17920, "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10}
PHI3_MEDIUM_128K = {  # microsoft/Phi-3-medium-128k-instruct
    **PHI3_MEDIUM_4K, "max_position_embeddings": 131072, "sliding_window": 131072,
    "rope_scaling": {"long_factor": _factors(1.0, 25.0, 64), "short_factor": _factors(1.0, 1.9, 64),
                     "type": "su"}}
PHI4_MINI = {  # microsoft/Phi-4-mini-instruct: partial rotary 0.75, tied, GQA 24 / 8
    **PHI3_MINI_4K, "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999, "hidden_size": 3072,
    "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "partial_rotary_factor": 0.75, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
    "rope_scaling": {"long_factor": _factors(1.0, 40.0, 48), "short_factor": _factors(1.0, 1.5, 48),
                     "type": "longrope"}}

REAL_CONFIGS = {
    "llama-2-7b": LLAMA2_7B, "llama-3-8b": LLAMA3_8B, "llama-3.1-8b-instruct": LLAMA31_8B_INSTRUCT,
    "llama-3.2-1b": LLAMA32_1B, "llama-3.2-3b-instruct": LLAMA32_3B_INSTRUCT, "codellama-7b": CODELLAMA_7B,
    "tinyllama-1.1b": TINYLLAMA, "deepseek-coder-6.7b-instruct": DEEPSEEK_CODER_67B_INSTRUCT,
    "llama-2-7b-dynamic-ntk": LLAMA2_7B_DYNAMIC,
    "mistral-7b-v0.1": MISTRAL_7B_V01, "mistral-7b-v0.3": MISTRAL_7B_V03, "mistral-nemo": MISTRAL_NEMO,
    "mistral-7b-v0.3-head-dim-null": MISTRAL_7B_V03_HEAD_DIM_NULL,
    "qwen2-0.5b": QWEN2_05B, "qwen2-7b": QWEN2_7B, "qwen2.5-0.5b": QWEN25_05B, "qwen2.5-7b": QWEN25_7B,
    "qwen2.5-7b-instruct": QWEN25_7B_INSTRUCT, "qwen2.5-7b-instruct-yarn": QWEN25_7B_INSTRUCT_YARN,
    "qwen2.5-coder-7b-instruct": QWEN25_CODER_7B_INSTRUCT,
    "gemma-2b": GEMMA_2B, "gemma-7b": GEMMA_7B, "gemma-1.1-2b-it": GEMMA_11_2B_IT, "codegemma-7b": CODEGEMMA_7B,
    "gemma-2-2b": GEMMA2_2B, "gemma-2-9b": GEMMA2_9B, "gemma-2-27b": GEMMA2_27B, "gemma-3-1b": GEMMA3_1B,
    "gemma-3-270m": GEMMA3_270M,
    "phi-3-mini-4k": PHI3_MINI_4K, "phi-3-mini-128k-su": PHI3_MINI_128K,
    "phi-3-mini-128k-longrope": PHI3_MINI_128K_LONGROPE, "phi-3.5-mini": PHI35_MINI,
    "phi-3-medium-4k": PHI3_MEDIUM_4K, "phi-3-medium-128k": PHI3_MEDIUM_128K, "phi-4-mini": PHI4_MINI,
}

VOCAB = 512
SEQ = 12


def shrink(real: dict) -> dict:
    """Small sizes, real numerics: 2 layers, a 512-token vocabulary, one kv group of the real group size (2 heads
    for multi-head models) with the real head_dim; an explicit head_dim that differs from hidden / heads still
    differs."""
    cfg = json.loads(json.dumps(real))
    heads, kv = real["num_attention_heads"], real.get("num_key_value_heads") or real["num_attention_heads"]
    head_dim = real.get("head_dim") or real["hidden_size"] // heads
    group = heads // kv
    new_heads, new_kv = (group, 1) if group > 1 else (2, 2)
    explicit_mismatch = real.get("head_dim") is not None and real["hidden_size"] != heads * head_dim
    cfg.update(num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=64, num_attention_heads=new_heads,
               num_key_value_heads=new_kv, hidden_size=96 if explicit_mismatch else new_heads * head_dim)
    if cfg.get("layer_types"):  # two consecutive entries, the first full layer among them where there is one
        types = real["layer_types"]
        first = max(0, types.index("full_attention") - 1) if "full_attention" in types else 0
        cfg["layer_types"] = types[first : first + 2]
    if "max_window_layers" in cfg:  # keep "window layers start past the last layer" vs "inside the stack"
        cfg["max_window_layers"] = 2 if real["max_window_layers"] >= real["num_hidden_layers"] else 1
    # nn.Embedding rejects a padding_idx outside the (shrunk) table, in transformers as here.
    if cfg.get("pad_token_id") is not None and cfg["pad_token_id"] >= VOCAB:
        cfg["pad_token_id"] = VOCAB - 1
    return cfg


def hf_spelling(cfg: dict) -> dict:
    """The config transformers is given: the same, except that the original Phi-3 rope type "su" is spelled
    "longrope". transformers 5.x renames "su" only after it has copied the top-level
    original_max_position_embeddings into the rope dict (which it does for "longrope" alone), so it fails on the
    file Microsoft first published (KeyError: missing original_max_position_embeddings); earlier releases read it.
    Gemma v1's activation is spelled "gelu_pytorch_tanh", the tanh approximation the family was trained with and
    the one transformers 5.24 and this project read from the legacy "gelu" with or without a hidden_activation key:
    under transformers 5.17 our logits for gemma-1.1's pair of keys ("gelu" and "gelu_pytorch_tanh") were 1.1e-4
    from its float64 run, ten times its float32 error, so the reference would depend on the installed version.
    """
    rope = cfg.get("rope_scaling")
    if rope and rope.get("type") == "su":
        cfg = {**cfg, "rope_scaling": {**rope, "type": "longrope"}}
    if cfg["model_type"] == "gemma":
        cfg = {**cfg, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    return cfg


def hf_checkpoint(cfg: dict, directory) -> transformers.PreTrainedModel:
    """transformers' model built from config.json, saved, with the original config.json written back."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_spelling(cfg)))
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    # float32 from the start: built in the config's bf16 and cast afterwards, HF's non-persistent buffers (Gemma's
    # √hidden embedding scale) would keep their bf16 rounding, which no real float32 load has.
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    assert hf.dtype == torch.float32
    perturb_norms(hf)
    hf.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(cfg))  # the file as the Hub serves it
    return hf


def hf_window(hf, layer_idx: int) -> int | None:
    """The sliding window transformers' eager attention applies in a layer (None: full causal)."""
    attention = hf.model.layers[layer_idx].self_attn
    if hasattr(attention, "sliding_window"):  # Qwen2: per layer, from layer_types
        return attention.sliding_window
    # Mistral and Phi3 pass config.sliding_window to every layer; Llama and Gemma have no window.
    return hf.config.sliding_window if hf.config.model_type in ("mistral", "phi3") else None


def switch_length(cfg: dict) -> int | None:
    """The length past which the checkpoint's rope changes regime (longrope / llama3 / yarn), if any."""
    rope = cfg.get("rope_scaling")
    if not rope:
        return None
    return cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or cfg["max_position_embeddings"]


def position_batches(cfg: dict) -> list[torch.Tensor]:
    """position_ids to compare on: from 0 and packed (two documents) in one batch; then runs ending just below and
    just past the rope switch (longrope changes factors there); then a run near max_position_embeddings."""
    plain, packed = torch.arange(SEQ), torch.cat([torch.arange(7), torch.arange(SEQ - 7)])
    batches = [torch.stack([plain, packed])]
    switch = switch_length(cfg)
    if switch is not None:
        below = torch.arange(switch - SEQ, switch)  # max(position) + 1 == switch: short factors
        batches += [below[None], (below + 1)[None]]
        # packed, with the second document past the switch
        batches.append(torch.cat([torch.arange(5), torch.arange(switch - 2, switch + SEQ - 7)])[None])
    far = cfg["max_position_embeddings"] - SEQ
    if far > SEQ and far != (switch or 0) - SEQ:
        batches.append(torch.arange(far, far + SEQ)[None])
    return batches


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_config_matches_transformers(tmp_path, name):
    cfg = shrink(REAL_CONFIGS[name])
    hf = hf_checkpoint(cfg, tmp_path / "hf")
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert ours.config.model_type == cfg["model_type"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert ours.config.head_dim == head_dim
    assert ours.config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    for i in range(cfg["num_hidden_layers"]):  # windows too long for these inputs: compare the values instead
        assert ours.config.layer_sliding_window(i) == hf_window(hf, i), f"layer {i}"
    check_parity(hf, tmp_path / "hf", SEQ, grads=False, ours=ours)  # no position_ids: both default to 0 … T − 1
    for positions in position_batches(cfg):
        check_parity(hf, tmp_path / "hf", SEQ, batch=positions.shape[0], position_ids=positions, grads=False,
                     ours=ours)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-7b-instruct-yarn", "phi-3.5-mini"])
def test_real_config_gradients(tmp_path, name):
    """Loss and every gradient too, for a few representative entries (tied head with llama3 rope, yarn, longrope in
    its long regime)."""
    cfg = shrink(REAL_CONFIGS[name])
    hf = hf_checkpoint(cfg, tmp_path / "hf")
    # One document (HF's loss, unlike ours, targets the first token of the next packed document), ending just past
    # the rope switch (or max_position_embeddings).
    end = switch_length(cfg) or cfg["max_position_embeddings"]
    check_parity(hf, tmp_path / "hf", SEQ, position_ids=torch.arange(end - SEQ + 1, end + 1)[None])



UNSUPPORTED = {
    # microsoft/Phi-3-small-8k-instruct: blocksparse attention, GEGELU, μP scaling; not the phi3 architecture.
    "phi-3-small": {"architectures": ["Phi3SmallForCausalLM"], "model_type": "phi3small", "hidden_size": 4096,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "gegelu_limit": 20.0,
                    "blocksparse_block_size": 64, "mup_attn_multiplier": 1.0, "vocab_size": 100352},
    # Qwen/Qwen2-57B-A14B: mixture of experts
    "qwen2-moe": {**QWEN2_7B, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
    # microsoft/Phi-3.5-MoE-instruct
    "phi-3.5-moe": {**PHI35_MINI, "architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe"},
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_architectures_are_refused(tmp_path, name):
    raw = UNSUPPORTED[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"unsupported model_type '{raw['model_type']}'"):
        AutoLigerForCausalLM.from_pretrained(tmp_path)


# Configs of families that have their own classes now, kept as look-alikes of an older family's config.json.
LOOK_ALIKES = {
    # google/gemma-2-2b: four norms per layer, softcaps, alternating windows (Gemma v1's look-alike).
    "gemma-2-2b": {**GEMMA_2B, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                   "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096},
    # mistralai/Mixtral-8x7B-v0.1: mixture of experts (Llama's look-alike).
    "mixtral-8x7b": {**MISTRAL_7B_V01, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "num_local_experts": 8, "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("name, family", [("gemma-2-2b", GemmaConfig), ("phi-3-small", Phi3Config),
                                          ("mixtral-8x7b", LlamaConfig)])
def test_a_family_refuses_a_neighbours_config(tmp_path, name, family):
    """A family's own class never reads a look-alike architecture's config.json as its own."""
    raw = {**UNSUPPORTED, **LOOK_ALIKES}[name]
    with pytest.raises(ValueError, match="expects model_type"):
        family.from_hf(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model_class = {GemmaConfig: LigerGemmaForCausalLM, Phi3Config: LigerPhi3ForCausalLM,
                   LlamaConfig: LigerLlamaForCausalLM}[family]
    with pytest.raises(ValueError, match=f"has '{raw['model_type']}'"):
        model_class.from_pretrained(tmp_path)


@pytest.mark.parametrize("key", LigerPhi3ForCausalLM.UNAPPLIED_DROPOUT)
def test_a_dropout_transformers_would_apply_in_training_is_named_when_training_starts(key):
    # Released checkpoints set these rates to 0 (the entries above carry 0.0 or leave them out); one that does not
    # would train with dropout under transformers and without it here, so entering training says so.
    config = Phi3Config.from_hf({**PHI3_MINI_4K, "num_hidden_layers": 1, "vocab_size": 64, "hidden_size": 64,
                                 "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, key: 0.1})
    model = LigerPhi3ForCausalLM(config)
    with pytest.warns(UserWarning, match=rf"config.json sets {key}=0.1, .* trains without that dropout"):
        model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.eval()  # inference takes no dropout: nothing to say
        LigerPhi3ForCausalLM(Phi3Config.from_hf({**config.to_hf(), key: 0.0})).train()
