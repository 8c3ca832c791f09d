"""Gemma 2 vs transformers (eager, the reference HF 5.25 itself defaults to): sandwich norms, query_pre_attn_scalar,
attention and final soft-caps that bind, alternating windowed / full layers with the sequence past the window, GQA,
head_dim ≠ hidden / heads; packed documents, cached decoding and the config round trip (the CLI:
tests/cli/test_gemma_cli.py)."""

import contextlib
import copy

import pytest
import torch
import transformers
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from liger_models import AutoLigerForCausalLM, Gemma2Config, LigerGemma2ForCausalLM

from liger_models.kernels.ops import softcap_attention
from liger_models.modules import attention
from tests.helpers import INTERPRETER_ONLY

from .parity import (build_hf, check_bf16_parity, check_cached_generate, check_packed_documents, check_parity,
                     check_roundtrip, save_hf)

# Layers: sliding, full, sliding, full. qpas 24 ≠ head_dim 32; window 5 < every sequence below.
GEMMA2 = dict(head_dim=32, num_hidden_layers=4, sliding_window=5, query_pre_attn_scalar=24,
              attn_logit_softcapping=3.0, final_logit_softcapping=2.0)


def sharpen_(hf, qk: float = 8.0, embed: float = 6.0) -> None:
    """Scale q/k projections and the (tied) embedding so that scores reach about twice the attention cap (3) and
    logits about twice the final cap (2): both caps bind without saturating everything (at HF's init, std 0.02,
    scores and logits stay far below any cap and the tanh is nearly the identity)."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk)
            layer.self_attn.k_proj.weight.mul_(qk)
        hf.model.embed_tokens.weight.mul_(embed)


def build(**overrides):
    hf = build_hf(transformers.Gemma2Config, **{**GEMMA2, **overrides})
    sharpen_(hf)
    return hf


def test_caps_bind_in_this_setup():
    """The soft-caps change HF's own logits here (so the parity tests below test them)."""
    hf = build()
    ids = torch.randint(3, 128, (1, 16))
    with torch.no_grad():
        capped = hf(ids).logits
        hf.config.final_logit_softcapping = None
        uncapped_logits = hf(ids).logits
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped_scores = hf(ids).logits
    assert capped.abs().max() < 2.0 < uncapped_logits.abs().max()
    assert (uncapped_scores - uncapped_logits).abs().max() > 0.1


@pytest.mark.parametrize("v4_style", [False, True], ids=["v5-config", "v4-config"])
def test_parity_softcaps_windows_gqa(tmp_path, v4_style):
    hf = build()
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=v4_style), seq_len=17, batch=2)
    assert isinstance(ours, LigerGemma2ForCausalLM)
    assert [layer.self_attn.window for layer in ours.model.layers] == [5, None, 5, None]
    assert ours.config.attention_scale == 24**-0.5 and ours.config.logit_softcap == 2.0
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    check_roundtrip(ours, tmp_path / "ours", seq_len=12)


def test_released_caps_and_explicit_layer_types(tmp_path):
    # The released caps (50 / 30) and qpas = head_dim; layer_types given explicitly, full first.
    hf = build(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=32,
               layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, 5, 5, None]


def test_caps_off(tmp_path):
    hf = build(attn_logit_softcapping=None, final_logit_softcapping=None)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=11, grads=False)
    assert ours.config.attention_softcap is None and ours.config.logit_softcap is None


def test_flex_score_mod_path_matches_hf(tmp_path):
    """flex_attention with the soft-cap score_mod, uncompiled on the CPU (forward only: flex has no CPU backward;
    the compiled CUDA path's gradients: test_flex_softcap_on_cuda_equals_the_math_path)."""
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    for layer in ours.model.layers:
        layer.self_attn.flex = "always"
    check_parity(hf, tmp_path / "hf", seq_len=15, ours=ours, grads=False)


def test_compiled_flex_takes_a_second_cap_in_one_process():
    """The compiled flex_attention (what long CUDA calls run) through the soft-cap score_mod, forward on the CPU,
    with two caps in one process (two models, or a test suite): both equal the eager math. A cap closed over as a
    Python float makes the second compile unspecialise it and inductor's flex lowering fail
    (``LoweringException: unbacked_bindings``)."""
    compiled = torch.compile(flex_attention)
    for cap, T in ((3.0, 40), (5.0, 40), (3.0, 56)):
        q, k, v = torch.randn(2, 4, T, 16) * 4, torch.randn(2, 2, T, 16) * 4, torch.randn(2, 2, T, 16)
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device="cpu")
        out = compiled(q, k, v, score_mod=attention._softcap_score_mod(cap, q.device), block_mask=mask, scale=0.25,
                       enable_gqa=True)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        expected = attention.attend_softcapped_math(q, k, v, causal, 0.25, cap)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def _kernel_calls():
    """The list that each call of the soft-capped attention kernel appends to, while the block runs."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        kernel = softcap_attention._SoftcapAttention.apply
        mp.setattr(softcap_attention._SoftcapAttention, "apply", lambda *a: calls.append(1) or kernel(*a))
        yield calls


@INTERPRETER_ONLY  # the kernel itself on CPU tensors; compiled on CUDA: test_softcap_paths_on_cuda_equal_the_math_path
def test_softcap_attention_kernel_matches_hf(tmp_path):
    """This project's soft-capped attention kernel in every layer (windowed and full), through Triton's interpreter:
    logits, loss and every gradient against float64 HF; packed documents against separate HF runs."""
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    for layer in ours.model.layers:
        layer.self_attn.flex = "kernel"
    with _kernel_calls() as calls:
        check_parity(hf, tmp_path / "hf", seq_len=17, batch=2, ours=ours)
        assert len(calls) >= len(ours.model.layers)
        calls.clear()
        check_packed_documents(hf, ours, (6, 9, 3))
        assert calls


def test_cpu_auto_calls_keep_the_math_path():
    """The kernel is preferred for CUDA training calls only: on the CPU (where Triton's interpreter would run it) an
    "auto" call keeps HF's math, so the CPU parity tests check that path; "kernel" still forces the kernel."""
    assert softcap_attention.TUNING.preferred
    model = LigerGemma2ForCausalLM.from_config(Gemma2Config.tiny(attn_logit_softcapping=3.0))
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    with _kernel_calls() as calls:
        model(ids, labels=ids).loss.backward()
        assert calls == []
        for layer in model.model.layers:
            layer.self_attn.flex = "kernel"
        model(ids, labels=ids).loss.backward()
        assert len(calls) == len(model.model.layers)


def softcap_case():
    """The CUDA soft-cap test's fp32 model (q/k weights × 8: scores that reach the cap) and its 2 × 640 tokens
    (benchmarks/tools/softcap_error_spread.py draws many of them)."""
    config = Gemma2Config.tiny(sliding_window=64, attn_logit_softcapping=3.0)
    reference = LigerGemma2ForCausalLM.from_config(config, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return reference, torch.randint(3, config.vocab_size, (2, 640), device="cuda")


def _loss_and_grads(model, ids, flex):
    for layer in model.model.layers:
        layer.self_attn.flex = flex
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def _rel_err(got, ref):
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["flex", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_paths_on_cuda_equal_the_math_path(dtype, path, tune):
    """Compiled flex_attention (what a CUDA call of FLEX_MIN_LEN+ queries takes unless the kernel is preferred) and
    this project's soft-capped attention kernel against the eager math path in fp32: loss and every gradient. fp32
    to 1e-4 relative; bf16 no further from the fp32 reference than twice the bf16 math path's own error (HF eager's
    op order, which rounds its probabilities to bf16), or 2⁻⁸."""
    tune(softcap_attention, preferred=path == "kernel")
    reference, ids = softcap_case()
    ref_loss, ref_grads = _loss_and_grads(reference, ids, "never")
    if dtype == torch.float32:
        flex_loss, flex_grads = _loss_and_grads(reference, ids, "auto")
        assert abs(flex_loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
        for name, grad in flex_grads.items():
            assert _rel_err(grad, ref_grads[name]) <= 1e-4, name
        return
    model = copy.deepcopy(reference).to(dtype)
    flex_loss, flex_grads = _loss_and_grads(model, ids, "auto")
    math_loss, math_grads = _loss_and_grads(model, ids, "never")
    assert abs(flex_loss - ref_loss) <= max(2 * abs(math_loss - ref_loss), 2**-8 * abs(ref_loss))
    for name, grad in flex_grads.items():
        flex_err, math_err = _rel_err(grad, ref_grads[name]), _rel_err(math_grads[name], ref_grads[name])
        assert flex_err <= max(2 * math_err, 2**-8), (name, flex_err, math_err)


def test_packed_documents_match_separate_hf_runs(tmp_path):
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    docs = check_packed_documents(hf, ours, (6, 9, 3))
    # The loss of the packed row equals HF's mean over the documents' own targets.
    labels = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    loss = ours(labels, labels=labels, position_ids=position_ids).loss
    with torch.no_grad():
        logits = [hf(doc, use_cache=False).logits[0, :-1] for doc in docs]
    ref_loss = torch.nn.functional.cross_entropy(torch.cat(logits), torch.cat([d[0, 1:] for d in docs]))
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, ref_loss.item())


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_decoding_across_the_window_equals_hf(tmp_path):
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_cached_generate(hf, ours, 6, 9)


def test_config_defaults_layer_types_and_errors():
    cfg = Gemma2Config.from_hf({"model_type": "gemma2", "num_hidden_layers": 5})
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping,
            cfg.final_logit_softcapping) == (4096, 256, 50.0, 30.0)
    assert cfg.tie_word_embeddings and cfg.activation == "gelu_tanh" and cfg.head_dim == 256
    assert cfg.to_hf()["layer_types"] == cfg.layer_types
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma2Config.from_hf({"model_type": "gemma2", "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        Gemma2Config.tiny(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="unknown layer type"):
        Gemma2Config.tiny(layer_types=["local"] * 4)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma2Config.tiny(attn_logit_softcapping=0.0)
    model = LigerGemma2ForCausalLM.from_config(Gemma2Config.tiny())
    names = {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")}
    assert {f"model.layers.0.{n}_layernorm.weight" for n in ("input", "post_attention", "pre_feedforward",
                                                                "post_feedforward")} <= names



def test_hidden_states_biases_and_the_wrapped_head_path(tmp_path):
    """The final hidden states (before the capped head) equal HF's; attention_bias puts biases on q, k, v and o; a
    head the fused loss cannot read (hooked, as PEFT's LoRA on lm_head is) still gets the final cap, through
    cross_entropy on its logits."""
    hf = build(attention_bias=True)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(std=0.1)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=12)
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        ref = hf.model(ids, use_cache=False).last_hidden_state
        err = (ours.base_model(ids).last_hidden_state - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item())
    fused = ours(ids, labels=ids).loss
    handle = ours.lm_head.register_forward_hook(lambda module, args, out: out)
    try:
        wrapped = ours(ids, labels=ids).loss
    finally:
        handle.remove()
    assert abs(wrapped.item() - fused.item()) <= 1e-5 * max(1.0, fused.item())


def test_medusa_base_loss_is_the_capped_loss():
    """Stage 2's base term is the base model's own (capped) loss; the heads train on their own uncapped logits."""
    from liger_models.medusa import MedusaModel

    # Weights at std 0.3: logits of a few units, so the cap of 0.5 moves this loss far more than rounding does (at
    # the default 0.02 the logits are ~0.1 and the cap changes the loss by ~1e-3 only).
    base = LigerGemma2ForCausalLM.from_config(Gemma2Config.tiny(final_logit_softcapping=0.5, initializer_range=0.3))
    ids = torch.randint(3, 128, (2, 10))
    medusa = MedusaModel.from_base(base, num_heads=2, stage=2)
    out = medusa(ids, labels=ids)
    with torch.no_grad():
        own = base(ids, labels=ids).loss
        uncapped = torch.nn.functional.cross_entropy(base.lm_head(base.model(ids))[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten())
    assert abs(out.base_loss.item() - own.item()) <= 1e-5 * own.item()
    assert abs(own.item() - uncapped.item()) > 0.1  # the cap changes this loss


def test_bf16_within_hf_bf16_error(tmp_path):
    """bf16 (the Triton kernels' bf16 paths, the soft-caps in bf16): logits, loss and every gradient within 2× the
    error of HF's own bf16 run, both measured against HF in fp32."""
    hf = build()
    check_bf16_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)


def test_padded_batches_match_hf(tmp_path):
    """attention_mask through the soft-capped attention: left padding (windows binding) equals HF at the real
    tokens; right padding (windows longer than the rows) equals HF at every position, padded queries included;
    the flex score_mod path takes the same padding rule as the math path."""
    from .test_inference import left_padded

    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids, mask = left_padded(3, 12, [4, 0, 7])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, position_ids=positions).logits
        ref = hf(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        assert (out[mask.bool()] - ref[mask.bool()]).abs().max().item() <= 1e-4
        for layer in ours.model.layers:
            layer.self_attn.flex = "always"
        flex = ours(ids, attention_mask=mask, position_ids=positions).logits
        assert (flex[mask.bool()] - out[mask.bool()]).abs().max().item() <= 1e-5
    wide = build(sliding_window=64)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(wide, tmp_path / "wide"), dtype=torch.float32)
    ids, mask = ids.flip(-1), mask.flip(-1)
    with torch.no_grad():
        out, ref = ours(ids, attention_mask=mask).logits, wide(ids, attention_mask=mask, use_cache=False).logits
    assert (out - ref).abs().max().item() <= 1e-4
