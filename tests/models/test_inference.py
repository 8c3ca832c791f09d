"""Packed sequences, KV-cache decoding, generate, label shifting and RoPE tables (shared modules, all families)."""

import pytest
import torch
import transformers

from liger_models import LigerLlamaForCausalLM, LigerMistralForCausalLM, LigerPhi3ForCausalLM, LlamaConfig, \
    MistralConfig, Phi3Config
from liger_models.modules import KVCache, shift_labels
from liger_models.modules.rope import RotaryEmbedding

from .parity import build_hf, save_hf


@pytest.mark.parametrize("flex", ["never", "always"], ids=["bool-mask", "flex-block-mask"])
def test_packed_equals_separate_documents(flex):
    """Three documents packed in one row (window 5 < doc lengths) give each document's own logits and loss."""
    model = LigerMistralForCausalLM.from_config(MistralConfig.tiny(sliding_window=5))
    for layer in model.model.layers:
        layer.self_attn.flex = flex
    lengths = [7, 4, 9]
    docs = [torch.randint(3, 128, (1, n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = model(packed, position_ids=position_ids).logits
        ref = torch.cat([model(d).logits for d in docs], dim=1)
        assert (out - ref).abs().max().item() <= 1e-5
        loss = model(packed, labels=packed, position_ids=position_ids).loss
        per_doc = [model(d, labels=d).loss * (n - 1) for d, n in zip(docs, lengths)]
        assert abs(loss.item() - (sum(per_doc) / (sum(lengths) - 3)).item()) <= 1e-5


def test_packed_matches_hf(tmp_path):
    """transformers ≥ 5 also detects packing from position_ids; logits agree."""
    hf = build_hf(transformers.LlamaConfig)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    ids = torch.randint(3, 128, (1, 14))
    position_ids = torch.cat([torch.arange(6), torch.arange(8)])[None]
    with torch.no_grad():
        err = (ours(ids, position_ids=position_ids).logits - hf(ids, position_ids=position_ids,
                                                                  use_cache=False).logits).abs().max()
    assert err.item() <= 1e-4


@pytest.mark.parametrize("family", ["mistral-window", "phi3-longrope"])
def test_kv_cache_decoding_equals_full_forward(family):
    if family == "mistral-window":
        model = LigerMistralForCausalLM.from_config(MistralConfig.tiny(sliding_window=4))
    else:
        half = 8  # rotary_dim / 2 for head_dim 16
        rope = {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(half)],
                "long_factor": [2.0 + i for i in range(half)]}
        config = Phi3Config.tiny(rope_scaling=rope, original_max_position_embeddings=32)
        model = LigerPhi3ForCausalLM.from_config(config)
    ids = torch.randint(3, 128, (2, 13))
    with torch.no_grad():
        full = model(ids).logits
        cache = KVCache()
        steps = [model(ids[:, :6], past_key_values=cache, use_cache=True).logits]  # prefill
        steps.append(model(ids[:, 6:9], past_key_values=cache, use_cache=True).logits)  # chunked prefill
        for t in range(9, 13):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    assert cache.seq_length() == 13
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


def test_generate_greedy_equals_hf(tmp_path):
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    prompt = torch.randint(3, 128, (2, 5))
    ref = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0)
    out = ours.generate(prompt, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    assert torch.equal(out, ref)


def test_generate_stops_on_generation_config_eos_like_hf(tmp_path):
    """An instruct checkpoint's generation_config.json lists the end-of-turn id that config.json does not: plain
    generate, Medusa decoding and HF's generate all stop there by default; save_pretrained keeps the file."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    prompt = torch.randint(3, 128, (1, 5))
    free = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0)
    stop = int(free[0, 5 + 3])  # the 4th generated token plays end-of-turn
    hf.generation_config = transformers.GenerationConfig(eos_token_id=[2, stop], pad_token_id=0, do_sample=False)
    path = save_hf(hf, tmp_path / "hf")
    ref = hf.generate(prompt, max_new_tokens=8)
    assert ref.shape[1] < free.shape[1] and int(ref[0, -1]) == stop
    ours = LigerLlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert ours.generation_config["eos_token_id"] == [2, stop]
    assert torch.equal(ours.generate(prompt, max_new_tokens=8), ref)
    from liger_models.medusa import MedusaModel

    medusa = MedusaModel.from_base(ours, num_heads=2)
    assert torch.equal(medusa.generate(prompt, max_new_tokens=8), ref)
    ours.save_pretrained(tmp_path / "ours")
    again = LigerLlamaForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert again.generation_config == ours.generation_config


@pytest.mark.parametrize("generation_keys", [("eos_token_id",), ()], ids=["eos-no-pad", "neither"])
def test_generation_config_file_alone_sets_the_defaults_like_hf(tmp_path, generation_keys):
    """With a generation_config.json, HF's generate never reads config.json's eos / pad ids: a file without
    pad_token_id fills finished rows with the first EOS (not config.json's pad), one without eos_token_id does not
    stop at config.json's EOS."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True, pad_token_id=5)
    for _ in range(50):  # prompts whose row 0 emits a token first that row 1 never emits: it plays EOS
        prompt = torch.randint(6, 128, (2, 4))
        free = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                           eos_token_id=[], pad_token_id=5)[:, 4:]
        eos = int(free[0, 0])
        if eos not in free[1].tolist() and eos != 5:
            break
    else:
        raise AssertionError("no prompt pair in 50 lets one row finish before the other")
    hf.config.eos_token_id = eos
    hf.generation_config = transformers.GenerationConfig(**{k: eos for k in generation_keys}, do_sample=False)
    path = save_hf(hf, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ref = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6)
    ours = LigerLlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert ours.config.pad_token_id == 5 and ours.config.eos_token_id == eos
    assert torch.equal(ours.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6), ref)


def test_generate_crossing_longrope_switch_equals_hf(tmp_path):
    """Phi3 generation that crosses original_max_position_embeddings recomputes the cache, as HF does."""
    half = 8
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(half)],
            "long_factor": [3.0 + i for i in range(half)]}
    hf = build_hf(transformers.Phi3Config, max_position_embeddings=64, original_max_position_embeddings=8,
                  rope_parameters=rope)
    ours = LigerPhi3ForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    prompt = torch.randint(3, 128, (1, 5))
    # HF without a cache: every step rotates the whole sequence with the factor its length selects, which is what
    # recomputing the cache at the switch gives. HF's cached generate does the recompute only in some versions
    # (transformers 5.17 kept the short-factor cache: its prepare_inputs_for_generation saw one token per step).
    ref = hf.generate(prompt, max_new_tokens=7, do_sample=False, eos_token_id=2, pad_token_id=0, use_cache=False)
    assert torch.equal(ours.generate(prompt, max_new_tokens=7, eos_token_id=2, pad_token_id=0), ref)


def test_generate_sampling_and_eos():
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    prompt = torch.randint(3, 128, (3, 4))
    gen = torch.Generator().manual_seed(0)
    out = model.generate(prompt, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                         generator=gen)
    assert out.shape[0] == 3 and 4 < out.shape[1] <= 10 and torch.equal(out[:, :4], prompt)
    greedy = model.generate(prompt, max_new_tokens=3, eos_token_id=[])
    first = int(greedy[0, 4])  # make the first row's first greedy token an EOS: it stops, others go on
    stopped = model.generate(prompt, max_new_tokens=3, eos_token_id=first, pad_token_id=0)
    assert stopped[0, 4] == first and (stopped[0, 5:] == 0).all()
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="at least one token"):  # an IndexError before
        model.generate(prompt[:, :0], max_new_tokens=2)
    with pytest.raises(ValueError, match="batch, seq_len"):  # "not enough values to unpack" before
        model(prompt[0])


def test_shift_labels_documents():
    labels = torch.arange(10, 18)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    assert shift_labels(labels, 1).tolist() == [[11, 12, 13, 14, 15, 16, 17, -100]]
    assert shift_labels(labels, 1, pos).tolist() == [[11, 12, -100, 14, 15, 16, -100, -100]]
    assert shift_labels(labels, 2, pos).tolist() == [[12, -100, -100, 15, 16, -100, -100, -100]]
    assert shift_labels(labels, 9).tolist() == [[-100] * 8]


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "attention_factor": 1.25},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
], ids=["default", "linear", "dynamic", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor",
        "yarn-betas-untruncated"])
def test_rope_tables_match_hf(rope):
    """cos/sin at positions beyond max_position_embeddings (dynamic kicks in) equal HF's rotary embedding; yarn's
    ramp, attention factor and mscale ratio as HF computes them."""
    hf_rope = {"rope_type": "default", "rope_theta": 50000.0, **(rope or {})}
    hf_cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=16,
                                      rope_parameters=hf_rope)
    ours = RotaryEmbedding(LlamaConfig.from_hf(hf_cfg.to_dict()))
    reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    pos = torch.arange(40)[None]
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = ours(pos)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


@pytest.mark.parametrize("inner", [8, None], ids=["inner-key", "no-inner-key"])
def test_top_level_original_max_positions_is_read_as_hf_reads_it(inner):
    """A Llama config.json with a top-level original_max_position_embeddings (Phi3 keeps it there) and llama3 rope:
    HF ignores the top-level key outside Phi3 (rope's own value, else max_position_embeddings); so do we."""
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}
    if inner is not None:
        rope["original_max_position_embeddings"] = inner
    config_json = dict(model_type="llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                       original_max_position_embeddings=4, rope_scaling=rope)
    hf_cfg = transformers.LlamaConfig.from_dict(config_json)
    config = LlamaConfig.from_hf(dict(config_json))
    ours = RotaryEmbedding(config)
    reference = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    saved = config.to_hf()  # the value used is written where every transformers version reads it
    assert saved["original_max_position_embeddings"] == saved["rope_scaling"]["original_max_position_embeddings"] == 4
    assert "original_max_position_embeddings" not in LlamaConfig.tiny().to_hf()
    pos = torch.arange(48)[None]
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = ours(pos)
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


def test_packed_projections_keep_identity_and_fall_back():
    """q|k|v and gate|up share one buffer (one GEMM) across .to(); unpacked parameters give the same result."""
    from liger_models.modules.linear import packed_linear

    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny(attention_bias=True))
    attn = model.model.layers[0].self_attn
    before = [id(p) for p in model.parameters()]
    model.to(torch.bfloat16).to(torch.float32)
    assert [id(p) for p in model.parameters()] == before
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(2, 5, 64, requires_grad=True)
    results = []
    for packed in (True, False):
        if not packed:  # break the shared layout: the op must concatenate instead
            for lin in linears:
                lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
        x.grad = None
        out = packed_linear(x, linears)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad.clone(), [lin.weight.grad.clone() for lin in linears]))
    reference = torch.cat([lin(x) for lin in linears], dim=-1)
    assert torch.allclose(results[0][0], reference, atol=1e-6) and torch.allclose(results[1][0], reference, atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0][2], results[1][2]))


def left_padded(batch: int, length: int, pads: list[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts (ids ≥ 3) with pads[b] pad tokens on the left of row b, and their attention_mask."""
    ids = torch.randint(3, 128, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(pads):
        ids[b, :n], mask[b, :n] = pad_id, 0
    return ids, mask


@pytest.mark.parametrize("positions", ["default", "from-mask"])
def test_left_padded_forward_matches_hf(tmp_path, positions):
    """attention_mask hides padded keys (with a sliding window too); logits of real tokens equal HF's."""
    hf = build_hf(transformers.MistralConfig, sliding_window=5)
    ours = LigerMistralForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    ids, mask = left_padded(3, 11, [4, 0, 7])
    kwargs = {"attention_mask": mask}
    if positions == "from-mask":  # what HF's generate passes
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out, ref = ours(ids, **kwargs).logits, hf(ids, use_cache=False, **kwargs).logits
    real = mask.bool()
    assert torch.isfinite(out).all()
    assert (out[real] - ref[real]).abs().max().item() <= 1e-4


def test_right_padded_forward_matches_hf_at_every_position(tmp_path):
    """A padded query after real tokens sees those tokens and not itself, as in HF: logits equal HF's everywhere,
    the padded positions included. (No window here: a padded query whose window holds no real key has an empty row
    in HF's mask, which HF's kernels fill in their own way.)"""
    hf = build_hf(transformers.LlamaConfig)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    ids, mask = left_padded(3, 11, [4, 0, 7])
    ids, mask = ids.flip(-1), mask.flip(-1)  # right padding
    with torch.no_grad():
        out, ref = ours(ids, attention_mask=mask).logits, hf(ids, use_cache=False, attention_mask=mask).logits
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("window", [None, 3])
def test_padded_batch_takes_the_same_mask_through_flex_attention(window):
    """The flex BlockMask applies the padding rule the boolean mask does (padded queries between real tokens too)."""
    ours = LigerMistralForCausalLM.from_config(MistralConfig.tiny(sliding_window=window), dtype=torch.float32)
    ids, mask = left_padded(3, 11, [4, 0, 7])
    mask[0, 6] = 0  # a gap inside a row
    logits = {}
    for flex in ("never", "always"):
        for layer in ours.model.layers:
            layer.self_attn.flex = flex
        with torch.no_grad():
            logits[flex] = ours(ids, attention_mask=mask).logits
    assert (logits["always"] - logits["never"]).abs().max().item() <= 1e-5


def test_generate_left_padded_equals_hf(tmp_path):
    """Prompts of different lengths, left-padded: with an explicit attention_mask, and with the mask inferred from
    pad_token_id as HF's generate infers it."""
    hf = build_hf(transformers.LlamaConfig)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    prompt, mask = left_padded(3, 7, [3, 0, 5])
    ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, attention_mask=mask, max_new_tokens=6, eos_token_id=2, pad_token_id=0),
                       ref)
    assert torch.equal(ours.generate(prompt, max_new_tokens=6, eos_token_id=2, pad_token_id=0), ref)
    alone = ours.generate(prompt[1:2], max_new_tokens=6, eos_token_id=2, pad_token_id=0)  # the unpadded row
    # Alone it stops at its EOS; in the batch the finished row is filled with the pad id up to the longest row.
    n = alone.shape[1]
    assert torch.equal(alone, ref[1:2, :n]) and (ref[1, n:] == 0).all()
    assert n == ref.shape[1] or alone[0, -1] == 2


def test_logits_to_keep_like_hf(tmp_path):
    """HF v5's name ``logits_to_keep`` (an int: the last k positions; a tensor: those positions) is accepted."""
    hf = build_hf(transformers.LlamaConfig)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        for keep in (3, torch.tensor([0, 4, 8])):
            out, ref = ours(ids, logits_to_keep=keep).logits, hf(ids, logits_to_keep=keep, use_cache=False).logits
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= 1e-4
        assert torch.equal(ours(ids, num_logits_to_keep=2).logits, ours(ids, logits_to_keep=2).logits)
    with pytest.raises(ValueError, match="not both"):
        ours(ids, num_logits_to_keep=2, logits_to_keep=2)


def test_generate_fills_finished_rows_with_the_config_pad_like_hf(tmp_path):
    """Without a pad_token_id argument, a finished row is filled with the config's pad id (HF's default), not EOS."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True)  # pad 0, eos 2
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    for _ in range(20):  # a prompt pair whose second row does not also emit the first row's first token
        prompt = torch.randint(3, 128, (2, 5))
        free = ours.generate(prompt, max_new_tokens=4, eos_token_id=[])
        stop = int(free[0, 5])
        if stop not in free[1, 5:].tolist():
            break
    ref = hf.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=stop)
    assert ref.shape[1] == 9 and (ref[0, 6:] == 0).all()
    assert torch.equal(ours.generate(prompt, max_new_tokens=4, eos_token_id=stop), ref)


def test_generate_top_k_zero_disables_top_k_like_hf():
    """top_k=0 means no top-k filtering (HF's convention), not a crash. (top_k=None is "not given": the checkpoint's
    or HF's default 50; see test_generate_defaults.py.)"""
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    prompt = torch.randint(3, 128, (2, 4))
    kwargs = dict(max_new_tokens=4, do_sample=True, eos_token_id=[])
    out = model.generate(prompt, top_k=0, generator=torch.Generator().manual_seed(3), **kwargs)
    everything = model.config.vocab_size  # keeps every token
    assert torch.equal(out, model.generate(prompt, top_k=everything, generator=torch.Generator().manual_seed(3),
                                           **kwargs))
