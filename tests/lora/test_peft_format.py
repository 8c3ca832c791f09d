"""Adapters move between ours and HF + PEFT with the same logits (fp32: ours within 1e-5 of HF + PEFT in float64, or
within common.FP32_PEER_FACTOR times HF + PEFT's own fp32 error), merge / unmerge, merged export."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.lora import (LoraSettings, add_lora, load_adapter, lora_modules, merge_lora, quantize_base_,
                               save_adapter, save_merged, unmerge_lora)

from ..models.parity import float64_reference, max_rel
from .common import (CONFIGS, assert_as_close_as_fp32_allows, assert_unmerged_exactly, batch, pair, peft_float64,
                     ulp_moved_logits, with_adapters)

peft = pytest.importorskip("peft")
FP32 = 1e-5


def assert_same_logits(ours, hf_peft, clean_hf, ids, tmp_path):
    """Ours against HF + PEFT, both in fp32, judged by float64 HF + PEFT with the same adapter (on clean_hf, a copy
    of the base PEFT has not injected into): on some random tiny models a logit is a cancellation that fp32 gets to
    only ~3e-5 of the largest logit, in HF + PEFT too."""
    truth = peft_float64(clean_hf, ours, tmp_path / "float64")
    with torch.no_grad():
        exact = truth.eval()(input_ids=ids.clone()).logits
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, hf_peft.eval()(input_ids=ids).logits, exact,
                                       more_peers=(truth.fp32_peer().eval()(input_ids=ids).logits,),
                                       redraw=ulp_moved_logits(ours, ids))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_our_adapter_loads_in_hf_peft_with_the_same_logits(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path)
    with_adapters(ours, family, "all-linear")
    save_adapter(ours, tmp_path / "adapter", base_model="tiny")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    clean = copy.deepcopy(hf)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, _ = batch()
    assert_same_logits(ours, loaded, clean, ids, tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_hf_peft_adapter_loads_here_with_the_same_logits(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path)
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=names, init_lora_weights=False, use_rslora=True,
                             rank_pattern={"v_proj": 2} if family != "phi3" else {})
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, config)
    trained.save_pretrained(tmp_path / "hf_adapter")
    load_adapter(ours, tmp_path / "hf_adapter")
    ids, _ = batch()
    assert_same_logits(ours, trained, clean, ids, tmp_path)


def test_merge_unmerge_and_merged_export_loads_in_transformers(tmp_path):
    """Merged, unmerged and exported logits each as close to float64 HF + PEFT as the adapted model's own fp32
    logits are (twice that, or 1e-5): W + s·B·A rounded once is not bit-equal to W·x + s·B·(A·x). The export is
    judged computing in float64 (parity.float64_reference)."""
    hf, ours, _ = pair("qwen2", tmp_path)  # q/k/v biases
    with_adapters(ours, "qwen2", "all-linear")
    ids, _ = batch()
    ours.eval()
    with torch.no_grad():
        exact = peft_float64(hf, ours, tmp_path / "float64").eval()(input_ids=ids).logits
        adapted = ours(ids).logits
        bound = max(2 * max_rel(adapted.double(), exact), FP32)
        base_q = lora_modules(ours)["model.layers.0.self_attn.q_proj"].weight.clone()
        merge_lora(ours)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        unmerge_lora(ours)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        assert_unmerged_exactly(lora_modules(ours)["model.layers.0.self_attn.q_proj"], base_q)
    save_merged(ours, tmp_path / "merged")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert max_rel(float64_reference(hf_merged)(input_ids=ids).logits, exact) <= bound


def test_bad_input_is_refused_clearly(tmp_path):
    _, ours, _ = pair("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown LoRA target 'qkv_proj'"):
        add_lora(ours, LoraSettings(targets=["qkv_proj"]))
    with pytest.raises(ValueError, match="positive integer"):
        LoraSettings(r=0)
    _, tied, _ = pair("llama", tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="LoRA on lm_head: this model ties lm_head to embed_tokens"):
        add_lora(tied, LoraSettings(targets=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="DoRA on the embedding table"):
        add_lora(ours, LoraSettings(targets=["embed_tokens"], use_dora=True))
    with pytest.raises(ValueError, match="lm_head: both a LoRA target and in modules_to_save"):
        add_lora(ours, LoraSettings(targets=["lm_head"], modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        LoraSettings(dropout=1.0)
    # An adapter made for a different base shape.
    _, other, _ = pair("llama", tmp_path / "wide", hidden_size=96)
    with_adapters(other, "llama", "attention")
    save_adapter(other, tmp_path / "wide_adapter")
    with pytest.raises(ValueError, match="different base model"):
        load_adapter(ours, tmp_path / "wide_adapter")


@pytest.mark.parametrize("field, value", [("lora_bias", True), ("fan_in_fan_out", True),
                                          ("alora_invocation_tokens", [5, 6]), ("layer_replication", [[0, 2], [1, 2]]),
                                          ("use_qalora", True)])
def test_peft_options_that_change_the_math_are_refused_by_name(field, value, tmp_path):
    """PEFT options this implementation does not honour (a bias on B, activated LoRA, replicated layers, …): the
    adapter is refused naming the option, never loaded as if it were plain LoRA."""
    from safetensors.torch import save_file

    _, ours, _ = pair("llama", tmp_path)
    cfg = {**peft.LoraConfig(r=2, target_modules=["q_proj"]).to_dict(), field: value}
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(cfg, default=list))
    save_file({}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"{field}=.* is not supported"):
        load_adapter(ours, tmp_path / "adapter")
    assert not lora_modules(ours)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora", "astra"])
def test_adapters_whose_init_rewrote_the_base_are_refused(init, tmp_path):
    """PiSSA / OLoRA / Astra adapters apply to W minus their initial product, which PEFT recomputes from the base as
    it loads them: on the checkpoint as stored they would give other logits without a word (an Astra adapter of
    PEFT 0.22 loaded as plain LoRA was 1.7e-2 off HF + PEFT's logits, against 1e-5)."""
    hf, ours, _ = pair("llama", tmp_path)
    base = hf.model.layers[0].self_attn.q_proj.weight.detach().clone()
    if init == "astra":  # the adapter starts as W's projection on its outputs' principal directions (from data)
        astra = pytest.importorskip("peft.tuners.lora.astra", reason="Astra came with PEFT 0.22")
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init,
                                 astra_config=peft.tuners.lora.config.AstraConfig())
        ids, _ = batch()
        astra.preprocess_astra(hf, config, run_model=lambda: hf(input_ids=ids))
    else:
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=init)
    trained = peft.get_peft_model(hf, config)
    assert not torch.equal(trained.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, base)
    trained.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=rf"init_lora_weights='{init}' rewrites the base weights"):
        load_adapter(ours, tmp_path / "adapter")
    assert not lora_modules(ours)


def assert_loads_for_logits_only(ours, trained, clean_hf, tmp_path, refusal: str):
    """``trained`` (HF + PEFT), saved, is refused by load_adapter(..., trainable=True) with ``refusal``, leaving ours
    bare, and loads without it with HF + PEFT's logits."""
    trained.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=refusal):
        load_adapter(ours, tmp_path / "adapter", trainable=True)
    assert not lora_modules(ours)
    load_adapter(ours, tmp_path / "adapter")
    ids, _ = batch()
    assert_same_logits(ours, trained, clean_hf, ids, tmp_path)


def test_a_mica_adapter_loads_for_its_logits_and_is_refused_for_training_on(tmp_path):
    """PEFT's MiCA computes as plain LoRA (B the base's minor singular directions, A trained from zero) but keeps B
    frozen while it trains: loaded here it gives HF + PEFT's logits, and asked to train on it is refused, where
    training B too would silently leave MiCA's recipe."""
    hf, ours, _ = pair("llama", tmp_path)
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                      init_lora_weights="mica"))
    b = trained.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert not b.requires_grad and b.abs().sum() > 0  # PEFT's MiCA: a fixed, non-zero B
    with torch.no_grad():  # as if trained: A away from its zero start
        for name, p in trained.named_parameters():
            if "lora_A" in name:
                p.normal_(0, 0.5)
    assert_loads_for_logits_only(ours, trained, clean, tmp_path,
                                 refusal=r"init_lora_weights='mica' trains lora_A alone .*trainable=False")


def test_a_velora_adapter_loads_for_its_logits_and_is_refused_for_training_on(tmp_path):
    """PEFT's VeLoRA computes as plain LoRA and takes A's gradient from compressed activations: loaded here it gives
    HF + PEFT's logits, and asked to train on it is refused (training here would take the exact gradient)."""
    velora = getattr(peft.tuners.lora.config, "VeloraConfig", None)
    if velora is None:
        pytest.skip("VeLoRA came with PEFT 0.22")
    hf, ours, _ = pair("llama", tmp_path)
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                      init_lora_weights=False, velora_config=velora(num_groups=8)))
    assert_loads_for_logits_only(ours, trained, clean, tmp_path,
                                 refusal=r"velora_config=.* changes how PEFT trains .*trainable=False")
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["velora_config"]


@pytest.mark.parametrize("value", [True, 3, "on", {"groups": 2}, [1]])
def test_a_peft_field_this_code_does_not_know_is_refused_when_set(value, tmp_path):
    """A PEFT release newer than this code may add a LoRA variant in a new adapter_config.json field, as 0.22 did with
    Astra; loaded as plain LoRA it would be silently wrong, so a field not known here is refused by name when it
    holds a value, and passes when it is empty (null, false, {}, [])."""
    hf, ours, _ = pair("llama", tmp_path)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter")
    cfg_path = tmp_path / "adapter/adapter_config.json"
    saved = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**saved, "use_future_variant": value}))
    with pytest.raises(ValueError, match=r"PEFT field\(s\) use_future_variant=.* are not known to this version"):
        load_adapter(ours, tmp_path / "adapter")
    assert not lora_modules(ours)
    for empty in (None, False, {}, []):
        cfg_path.write_text(json.dumps({**saved, "use_future_variant": empty}))
        fresh = copy.deepcopy(ours)
        assert load_adapter(fresh, tmp_path / "adapter")


@pytest.mark.parametrize("init", ["pissa", "eva", "mica", 1, None])
def test_an_init_this_library_does_not_draw_is_refused_by_name(init):
    # PEFT names more initialisations than True / False / "gaussian"; any other, given for new adapters, would have
    # been drawn as kaiming-uniform A without a word.
    with pytest.raises(ValueError, match=rf"LoRA init {init!r} is not one of True, False, 'gaussian'"):
        LoraSettings(init=init)
    for drawn in (True, False, "gaussian"):
        assert LoraSettings(init=drawn).init == drawn


def test_save_pretrained_refuses_adapters_and_nf4_naming_the_writer_that_keeps_them(tmp_path):
    # An HF checkpoint would carry adapters under names transformers ignores, and NF4 weights not at all (they are
    # not in the state dict): transformers would load the bare base, or initialise those linears at random.
    _, ours, _ = pair("llama", tmp_path)
    with_adapters(ours, "llama", "attention")
    with pytest.raises(ValueError, match=r"carries LoRA adapters .*save_adapter\(model, dir\).*save_merged"):
        ours.save_pretrained(tmp_path / "adapted")
    merge_lora(ours)  # merged, the adapter tensors are still attached
    with pytest.raises(ValueError, match="carries LoRA adapters"):
        ours.save_pretrained(tmp_path / "merged")
    _, quantised, _ = pair("llama", tmp_path / "q")
    quantize_base_(quantised)
    with pytest.raises(ValueError, match=r"are NF4.*save_bnb_4bit\(model, dir\)"):
        quantised.save_pretrained(tmp_path / "nf4")
    assert not (tmp_path / "adapted").exists() and not (tmp_path / "nf4").exists()


def test_a_save_killed_midway_keeps_the_previous_adapter(tmp_path, monkeypatch):
    # An adapter saved over an earlier one, with the process dying while the weights file is half written: the
    # directory still holds the earlier adapter, whole, and no temporary is left under a name a reader would take.
    import liger_models.lora.peft_format as peft_format
    from liger_models.lora.peft_format import read_adapter

    _, ours, _ = pair("llama", tmp_path)
    with_adapters(ours, "llama", "attention")
    save_adapter(ours, tmp_path / "adapter")
    _, before = read_adapter(tmp_path / "adapter")
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.add_(1.0)

    def dies_halfway(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(peft_format, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(ours, tmp_path / "adapter")
    _, after = read_adapter(tmp_path / "adapter")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]


@pytest.mark.parametrize("tie, rows", [(False, [3, 5]), (True, [3, 5]),
                                       (False, {"embed_tokens": [3], "lm_head": [3, 4]}),
                                       (True, {"embed_tokens": [3, 5], "lm_head": [3, 5]})])
def test_a_peft_adapter_with_trainable_token_rows_loads_here_with_the_same_logits(tie, rows, tmp_path):
    """PEFT's trainable_token_indices (new tokens' rows of the embedding, and of a tied or named lm_head; on a tied
    model both tables named with the same ids, which PEFT ties and saves once): the rows load as the tables' token
    rows (the tables untouched until a merge), and ours saves them back (assert_same_logits loads our save in
    PEFT)."""
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=tie)
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False, trainable_token_indices=rows))
    with torch.no_grad():
        deltas = [p for n, p in trained.named_parameters() if "trainable_tokens_delta" in n]
        assert len(deltas) == (1 if isinstance(rows, list) or tie else 2)
        for p in deltas:  # they start as the rows' old values
            p.add_(torch.randn_like(p))
    trained.save_pretrained(tmp_path / "hf_adapter")
    before = ours.model.embed_tokens.weight.detach().clone()
    load_adapter(ours, tmp_path / "hf_adapter")
    assert torch.equal(ours.model.embed_tokens.weight, before)
    loaded = ours.model.embed_tokens.token_adapter
    assert loaded.ids == (rows if isinstance(rows, list) else rows["embed_tokens"])
    assert not loaded.trainable_tokens_delta.requires_grad
    if tie:
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
        assert ours.lm_head.token_rows is loaded
    ids = batch()[0]
    ids[0, :4] = torch.tensor([3, 5, 4, 3])  # the new tokens in the input
    assert_same_logits(ours, trained, clean, ids, tmp_path)


def test_trainable_token_rows_that_cannot_be_honoured_are_refused(tmp_path):
    hf, ours, _ = pair("llama", tmp_path)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3])) \
        .save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "trainable_token_indices": [500]}))
    with pytest.raises(ValueError, match=r"names token 500, but model.embed_tokens has 128 rows"):
        load_adapter(ours, tmp_path / "adapter")
    _, tied, _ = pair("llama", tmp_path / "tied", tie_word_embeddings=True)
    config_path.write_text(json.dumps({**config, "trainable_token_indices": {"embed_tokens": [3], "lm_head": [4]}}))
    with pytest.raises(ValueError, match=r"names lm_head \[4\], but this model ties it to embed_tokens \(one "
                                         r"matrix\) with rows \[3\]"):
        load_adapter(tied, tmp_path / "adapter")


def _model_state(model) -> tuple[dict, dict, dict, bool]:
    """What a refused load must leave unchanged: every tensor's values, every parameter's requires_grad, each
    module's class, and whether the model carries LoRA settings."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: type(m) for n, m in model.named_modules()}, hasattr(model, "lora_settings"))


@pytest.mark.parametrize("family, nf4", [("llama", False), ("phi3", False), ("llama", True)])
def test_a_refused_adapter_leaves_the_model_as_it_was(family, nf4, tmp_path):
    """load_adapter checks the whole file before it writes into the base: each way a file can be refused late
    (after the adapters are attached and partly filled) leaves no adapter attached and nothing frozen, and the
    right adapter then loads onto the same model with the logits it gives a fresh one."""
    from safetensors.torch import load_file, save_file

    _, ours, directory = pair(family, tmp_path)
    _, donor, _ = pair(family, tmp_path / "donor")
    if nf4:
        quantize_base_(ours)
        quantize_base_(donor)
    with_adapters(donor, family, "all-linear")
    save_adapter(donor, tmp_path / "good")
    tensors = load_file(str(tmp_path / "good" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
    last = sorted(k for k in tensors if k.endswith("lora_B.weight"))[-1]
    hidden = donor.config.hidden_size
    bad = {"missing": ({k: v for k, v in tensors.items() if k != last}, config),
           "wrong_shape": ({**tensors, last: tensors[last][:-1]}, config),
           "modules_to_save": ({**tensors, "base_model.model.lm_head.weight": torch.zeros(3, hidden)},
                               {**config, "modules_to_save": ["lm_head"]}),
           "token_rows": ({**tensors, "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta":
                           torch.zeros(2, hidden)}, {**config, "trainable_token_indices": [3]})}
    before = _model_state(ours)
    for kind, (files, cfg) in bad.items():
        (tmp_path / kind).mkdir()
        save_file(files, str(tmp_path / kind / "adapter_model.safetensors"))
        (tmp_path / kind / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError):
            load_adapter(ours, tmp_path / kind)
        after = _model_state(ours)
        assert after[1:] == before[1:], kind
        assert after[0].keys() == before[0].keys() and all(torch.equal(after[0][k], v) for k, v in before[0].items())
    load_adapter(ours, tmp_path / "good")
    fresh = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if nf4:
        quantize_base_(fresh)
    load_adapter(fresh, tmp_path / "good")
    ids = batch()[0]
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, fresh.eval()(ids).logits)


def test_a_module_that_cannot_take_an_adapter_leaves_the_model_as_it_was(tmp_path):
    """add_lora refuses a target that is no plain linear (here the second layer's q_proj, after the first layer's
    took its adapter) and puts back what it had attached and frozen."""
    _, ours, _ = pair("llama", tmp_path)

    class Wrapped(torch.nn.Linear):
        pass

    q = ours.model.layers[1].self_attn.q_proj
    wrapped = Wrapped(q.in_features, q.out_features, bias=False)
    wrapped.weight = q.weight
    ours.model.layers[1].self_attn.q_proj = wrapped
    before = _model_state(ours)
    with pytest.raises(TypeError, match="LoRA attaches to nn.Linear projections, got Wrapped"):
        add_lora(ours, LoraSettings(targets=["q_proj", "v_proj"]))
    after = _model_state(ours)
    assert after[1:] == before[1:]
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())
