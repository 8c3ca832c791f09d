"""GPU: bf16 parity at real widths (2 layers, real vocab), flex-attention packing, loading straight to the GPU.

For each full-width config the same random weights run as HF fp32 (the reference), HF bf16 and ours in bf16. Our
error against fp32 (logits, loss, every parameter's gradient) must be no worse than 2× HF bf16's own error (plus a
small floor for tensors HF gets almost exactly).
"""

import copy

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM, LigerMistralForCausalLM, MistralConfig
from liger_models.auto import model_class

from ..helpers import rel_l2

pytestmark = pytest.mark.gpu

REAL = {
    "llama-3.2-1b": (transformers.LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-1.5b": (transformers.Qwen2Config, dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma-2b": (transformers.GemmaConfig, dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=8192)),
    "mistral-7b": (transformers.MistralConfig, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        rms_norm_eps=1e-5, sliding_window=4096)),
    "gemma-2-9b": (transformers.Gemma2Config, dict(  # T = 1024 ≥ FLEX_MIN_LEN: the compiled flex score_mod path
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        sliding_window=4096, max_position_embeddings=8192)),
    "gemma-3-4b-text": (transformers.Gemma3TextConfig, dict(  # window 512 < T; both RoPE tables, linear ×8
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi-3-mini": (transformers.Phi3Config, dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
        rms_norm_eps=1e-5, sliding_window=2047, pad_token_id=32000)),
}


def bound(hf_err: float) -> float:
    return 2.0 * hf_err + 1e-3


@pytest.mark.parametrize("name", list(REAL))
def test_bf16_parity_real_width(name):
    check_bf16_parity_real_width(name, *REAL[name])


def check_bf16_parity_real_width(name: str, config_cls, kwargs: dict) -> None:
    """2 layers of the config at its real width, random init: ours in bf16 against HF fp32 on logits, loss and every
    parameter's gradient, no worse than HF bf16's own error (``bound``)."""
    torch.manual_seed(0)
    config = config_cls(**{"num_hidden_layers": 2, **kwargs})
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes for 7B-wide layers
        hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    with torch.no_grad():
        for n, p in hf32.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours = model_class(config.model_type).config_class.from_hf(config.to_dict())
    ours = AutoLigerForCausalLM.from_config(ours, dtype=torch.bfloat16, device="cuda")
    ours.load_state_dict(hf32.state_dict())  # MoE: HF v5's in-memory (stacked) expert names load too
    ids = torch.randint(0, config.vocab_size, (2, 1024), device="cuda")

    with torch.no_grad():
        ref = hf32(ids).logits.float()
        hf_err = rel_l2(hf16(ids).logits.float(), ref)
        our_err = rel_l2(ours(ids).logits.float(), ref)
        del ref
    assert our_err <= bound(hf_err), f"logits: ours {our_err:.2e} vs HF bf16 {hf_err:.2e}"

    losses = [m(ids, labels=ids).loss for m in (hf32, hf16, ours)]
    for loss in losses:
        loss.backward()
    ref_loss, hf_loss, our_loss = (loss.item() for loss in losses)
    assert abs(our_loss - ref_loss) <= 2 * abs(hf_loss - ref_loss) + 2e-3 * ref_loss, (our_loss, hf_loss, ref_loss)
    ref_params, hf_params = dict(hf32.named_parameters()), dict(hf16.named_parameters())
    for n, p in ours.named_parameters():
        hf_err = rel_l2(hf_params[n].grad, ref_params[n].grad)  # (rel_l2 widens chunk by chunk: no whole fp32 copy)
        our_err = rel_l2(p.grad, ref_params[n].grad)
        assert our_err <= bound(hf_err), f"{name} grad {n}: ours {our_err:.2e} vs HF bf16 {hf_err:.2e}"


def _flex_and_bool_mask_runs(model, ids, labels, **inputs):
    """({path: fp32 logits}, {path: {name: fp32 grad}}) with every layer's attention through flex ("always") and
    through the boolean mask ("never")."""
    outs, grads = {}, {}
    for flex in ("always", "never"):
        for layer in model.model.layers:
            layer.self_attn.flex = flex
        model.zero_grad(set_to_none=True)
        model(ids, labels=labels, **inputs).loss.backward()
        grads[flex] = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            outs[flex] = model(ids, **inputs).logits.float()
    return outs, grads


def test_packed_long_sequence_flex_matches_bool_mask_and_documents():
    """T = 4096 packed with a window: compiled flex_attention path vs explicit mask vs per-document runs."""
    torch.manual_seed(0)
    model = LigerMistralForCausalLM.from_config(
        MistralConfig.tiny(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                           vocab_size=1024, max_position_embeddings=8192, sliding_window=700),
        dtype=torch.bfloat16, device="cuda")
    lengths = [1500, 1000, 1596]
    docs = [torch.randint(0, 1024, (1, n), device="cuda") for n in lengths]
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    outs, grads = _flex_and_bool_mask_runs(model, ids, ids, position_ids=position_ids)
    with torch.no_grad():
        separate = torch.cat([model(d).logits.float() for d in docs], dim=1)  # each doc alone (its own flex/mask)
    assert rel_l2(outs["always"], outs["never"]) <= 1e-2
    assert rel_l2(outs["always"], separate) <= 1e-2
    for n in grads["never"]:
        assert rel_l2(grads["always"][n], grads["never"][n]) <= 2e-2, n


def test_padded_long_batch_flex_matches_bool_mask():
    """T = 1536 with left padding, right padding and a gap, windowed: the compiled flex BlockMask (its padding rule
    reads a per-slot tensor inside mask_mod) gives the boolean mask's logits and gradients."""
    torch.manual_seed(0)
    model = LigerMistralForCausalLM.from_config(
        MistralConfig.tiny(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                           vocab_size=1024, max_position_embeddings=4096, sliding_window=300),
        dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 1024, (3, 1536), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :400] = 0  # left padding
    mask[1, -500:] = 0  # right padding, longer than the window
    mask[2, 600:700] = 0  # a gap
    outs, grads = _flex_and_bool_mask_runs(model, ids, ids.masked_fill(mask == 0, -100), attention_mask=mask)
    assert torch.isfinite(outs["always"]).all()
    assert rel_l2(outs["always"], outs["never"]) <= 1e-2
    for n in grads["never"]:
        assert rel_l2(grads["always"][n], grads["never"][n]) <= 2e-2, n


def test_load_to_gpu_and_generate_like_hf(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().eval()
    hf.save_pretrained(tmp_path, max_shard_size="1MB")
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device="cuda")
    assert all(p.is_cuda for p in ours.parameters())
    prompt = torch.randint(3, 512, (2, 16), device="cuda")  # no pad id: HF would mask it
    ref = hf.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, max_new_tokens=24, eos_token_id=2, pad_token_id=0), ref)
