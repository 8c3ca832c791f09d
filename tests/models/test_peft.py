"""PEFT's LoRA on our models takes part exactly where the fused paths would read a projection's weight directly.

The fused q|k|v and gate|up GEMMs, norm → projection and gated activation → down paths, and the fused
linear-cross-entropy read ``weight`` of plain nn.Linear modules. A PEFT-wrapped (or hooked) projection is called as a
module instead: every adapter gets HF + PEFT's gradient, and adapters move between HF + PEFT and ours unchanged.
"""

from __future__ import annotations

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

from liger_models import AutoLigerForCausalLM  # noqa: E402
from liger_models.medusa import MedusaModel  # noqa: E402

from .parity import TINY_MOE, build_hf, max_rel, save_hf  # noqa: E402

ALL_LINEAR = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
CONFIGS = {"llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig,
           "qwen2": transformers.Qwen2Config, "phi3": transformers.Phi3Config}
FP32 = 2e-5  # ours (fp32, Triton interpreter) against HF (fp32, eager) through the same adapters


def _pair(family: str, tmp_path, **hf_overrides):
    hf = build_hf(CONFIGS[family], **hf_overrides)
    directory = save_hf(hf, tmp_path / family)
    return hf, AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _lora(targets, **kw) -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, **kw)


def _copy_adapters(src, dst) -> None:
    """dst's adapter weights := src's (same PEFT names on both sides)."""
    src_sd = {k: v for k, v in src.state_dict().items() if "lora_" in k}
    dst_sd = dst.state_dict()
    assert src_sd and set(src_sd) <= set(dst_sd), sorted(set(src_sd) - set(dst_sd))[:3]
    dst.load_state_dict(src_sd, strict=False)


def _batch(vocab: int = 128):
    ids = torch.randint(3, vocab, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


@pytest.mark.parametrize("family", sorted(ALL_LINEAR))
def test_lora_on_every_linear_matches_hf_peft_loss_and_adapter_gradients(family, tmp_path):
    _check_every_linear(family, tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_lora_on_every_linear_matches_hf_peft_on_the_gpu(family, tmp_path):
    """The CUDA kernels' fused paths, fp32 (TF32 off), against HF + PEFT on the same GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_every_linear(family, tmp_path, "cuda")


def _check_every_linear(family: str, tmp_path, device: str) -> None:
    hf, ours = _pair(family, tmp_path)
    hf, ours = hf.to(device), ours.to(device)
    ours_peft = peft.get_peft_model(ours, _lora(ALL_LINEAR[family], init_lora_weights=False))
    hf_peft = peft.get_peft_model(hf, _lora(ALL_LINEAR[family], init_lora_weights=False))
    _copy_adapters(ours_peft, hf_peft)
    ours_grads = _assert_same_step(ours_peft, hf_peft, device)
    assert len(ours_grads) == 2 * 2 * len(ALL_LINEAR[family])


def _assert_same_step(ours_peft, hf_peft, device: str = "cpu") -> dict:
    """One training step of both PEFT models: the same loss (fp32) and every adapter's gradient within 1e-4 of
    HF + PEFT's, none skipped. Returns ours' gradients by name."""
    ours_peft.train()
    hf_peft.train()
    ids, labels = (t.to(device) for t in _batch())
    loss = ours_peft(ids, labels=labels).loss
    ref = hf_peft(input_ids=ids, labels=labels).loss
    assert abs(loss.item() - ref.item()) <= FP32 * abs(ref.item())
    loss.backward()
    ref.backward()
    ours_grads = {n: p.grad for n, p in ours_peft.named_parameters() if p.requires_grad}
    hf_grads = {n: p.grad for n, p in hf_peft.named_parameters() if p.requires_grad}
    assert set(ours_grads) == set(hf_grads)
    for name, ref_grad in hf_grads.items():
        assert ours_grads[name] is not None, f"{name}: no gradient (the adapter was skipped)"
        assert max_rel(ours_grads[name], ref_grad) < 1e-4, name
    return ours_grads


@pytest.mark.parametrize("targets", [["q_proj", "k_proj"], ["gate_proj"], ["down_proj"], ["lm_head"]])
def test_lora_on_fused_paths_alone_trains_and_matches_hf(targets, tmp_path):
    """Targets the fused paths used to read past: with the default init (lora_B = 0) one optimizer step moves
    every lora_B, and the loss after it is HF + PEFT's after the same step."""
    hf, ours = _pair("llama", tmp_path)
    ours_peft = peft.get_peft_model(ours, _lora(targets))
    hf_peft = peft.get_peft_model(hf, _lora(targets))
    _copy_adapters(ours_peft, hf_peft)
    ids, labels = _batch()
    for model, kwargs in ((ours_peft, {}), (hf_peft, {})):
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model(input_ids=ids, labels=labels, **kwargs).loss.backward()
        opt.step()
    lora_b = {n: p for n, p in ours_peft.named_parameters() if "lora_B" in n}
    assert lora_b and all(p.abs().max() > 0 for p in lora_b.values()), "an adapter did not train"
    with torch.no_grad():
        after = ours_peft(ids, labels=labels).loss
        ref_after = hf_peft(input_ids=ids, labels=labels).loss
    assert abs(after.item() - ref_after.item()) <= FP32 * abs(ref_after.item())


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_adapter_moves_between_ours_and_hf_peft_with_the_same_logits(family, tmp_path):
    hf, ours = _pair(family, tmp_path)
    trained = peft.get_peft_model(ours, _lora(ALL_LINEAR[family], init_lora_weights=False))
    trained.save_pretrained(tmp_path / "ours_adapter")
    hf_loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "ours_adapter").eval()
    ids, _ = _batch()
    with torch.no_grad():
        ours_logits = trained.eval()(ids).logits
        hf_logits = hf_loaded(input_ids=ids).logits
    assert max_rel(ours_logits, hf_logits) < 1e-5

    # The reverse: an adapter trained on HF + PEFT loads into ours.
    hf2, _ = _pair(family, tmp_path / "b")
    hf_trained = peft.get_peft_model(hf2, _lora(ALL_LINEAR[family], init_lora_weights=False))
    hf_trained.save_pretrained(tmp_path / "hf_adapter")
    ours2 = AutoLigerForCausalLM.from_pretrained(tmp_path / "b" / family, dtype=torch.float32)
    ours_loaded = peft.PeftModel.from_pretrained(ours2, tmp_path / "hf_adapter").eval()
    with torch.no_grad():
        assert max_rel(ours_loaded(ids).logits, hf_trained.eval()(input_ids=ids).logits) < 1e-5


def test_forward_hooks_on_a_projection_run_and_their_changes_take_part(tmp_path):
    """A hooked projection is called as a module: a forward hook that scales its output changes the loss exactly as
    on HF (a fused path that read the weight would skip it)."""
    hf, ours = _pair("llama", tmp_path)
    calls = []

    def scale_output(module, args, output):
        calls.append(module)
        return output * 0.5

    ours.model.layers[1].mlp.up_proj.register_forward_hook(scale_output)
    hf.model.layers[1].mlp.up_proj.register_forward_hook(scale_output)
    ours.train()
    ids, labels = _batch()
    loss, ref = ours(ids, labels=labels).loss, hf(input_ids=ids, labels=labels).loss
    assert len(calls) == 2
    assert abs(loss.item() - ref.item()) <= FP32 * abs(ref.item())


def test_medusa_refuses_a_wrapped_base_lm_head(tmp_path):
    _, ours = _pair("llama", tmp_path)
    medusa = MedusaModel.from_base(ours, stage=2, num_heads=2, num_layers=1)
    peft.get_peft_model(medusa.base, _lora(["lm_head"]))
    ids, labels = _batch()
    with pytest.raises(ValueError, match="lm_head.*not a plain nn.Linear"):
        medusa(ids, labels=labels)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_prompt_tuning_with_padding_matches_hf_peft(tmp_path, family):
    """PEFT's prompt tuning feeds inputs_embeds with its virtual tokens first and a float 0/1 attention mask; with a
    left-padded row, the padded queries between the virtual tokens and the prompt see the virtual tokens as HF's do.
    Loss and the prompt embeddings' gradient match HF + PEFT's. Gemma: inputs_embeds are taken as they are (the √H
    scale is inside the embedding module, as in transformers v5), so the virtual tokens are not scaled again."""
    hf, ours = _pair(family, tmp_path)
    ids, labels = _batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels[1, :4] = -100
    results = []
    for model in (hf, ours):
        torch.manual_seed(0)  # the same random virtual-token init on both sides
        wrapped = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
        loss = wrapped(input_ids=ids, attention_mask=mask, labels=labels).loss
        (grad,) = torch.autograd.grad(loss, [p for p in wrapped.parameters() if p.requires_grad])
        results.append((loss.detach(), grad))
    (hf_loss, hf_grad), (loss, grad) = results
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * hf_loss.item()
    assert max_rel(grad, hf_grad) <= FP32


@pytest.mark.parametrize("config", [transformers.GemmaConfig, transformers.Gemma2Config,
                                    transformers.Gemma3TextConfig], ids=["gemma", "gemma2", "gemma3"])
def test_a_hook_on_the_input_embeddings_sees_and_changes_what_hfs_does(tmp_path, config):
    """HF Trainer's and TRL's NEFTune add noise to the output of ``get_input_embeddings()`` by a forward hook: on the
    families that scale their embeddings that output is scaled (transformers v5 scales inside the module), on ours
    too. With the scale applied after the module, the hook saw unscaled vectors and its noise came out √H times
    larger (logits far apart from HF's under the same hook)."""
    hf = build_hf(config)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 7))
    seen, logits = [], []
    for model in (hf, ours):
        noise = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.3
        handle = model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: (seen.append(out.detach()), out + noise)[1])
        logits.append(model(ids).logits.detach())
        handle.remove()
    assert max_rel(seen[1], seen[0]) <= FP32
    assert max_rel(logits[1], logits[0]) <= FP32


def _greedy_by_full_forwards(wrapped, ids, mask, steps: int) -> torch.Tensor:
    """Greedy tokens from whole-sequence forwards of a PEFT-wrapped model (its forward puts the virtual tokens
    first): the reference for decoding with a cache."""
    with torch.no_grad():
        for _ in range(steps):
            nxt = wrapped(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


@pytest.mark.parametrize("padded", [False, True])
def test_prompt_tuning_generate_decodes_with_the_virtual_tokens(tmp_path, padded):
    """PEFT's generate for prompt tuning patches prepare_inputs_for_generation to put its virtual tokens before the
    prompt: ours decodes with them in the cache and the mask, giving the greedy tokens of HF + PEFT's forward (HF +
    PEFT's own generate is no reference here: in transformers 5.25 / peft 0.21 its cached steps drift from its own
    forward's greedy tokens)."""
    hf, ours = _pair("llama", tmp_path)
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = 0, 0
    wrapped = {}
    for name, model in (("hf", hf), ("ours", ours)):
        torch.manual_seed(0)
        wrapped[name] = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
        with torch.no_grad():
            wrapped[name].prompt_encoder["default"].embedding.weight.mul_(8)  # virtual tokens that change the output
    with torch.no_grad():
        out = wrapped["ours"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       pad_token_id=0, eos_token_id=[])
        plain = ours.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=[])
    assert torch.equal(out, _greedy_by_full_forwards(wrapped["hf"], ids, mask, 6))
    assert not torch.equal(plain, out)  # the virtual tokens took part


def test_generate_refuses_a_patched_step_it_cannot_honour(tmp_path):
    """A patched prepare_inputs_for_generation asking for what the loop does not do (here an extra argument) is
    refused by name rather than ignored."""
    _, ours = _pair("llama", tmp_path)
    base = ours.prepare_inputs_for_generation
    ours.prepare_inputs_for_generation = lambda *a, **k: {**base(*a, **k), "task_ids": torch.zeros(1)}
    with pytest.raises(ValueError, match="asks for task_ids, which this model's decoding loop does not take"):
        ours.generate(torch.randint(3, 128, (1, 4)), max_new_tokens=2)


@pytest.mark.parametrize("variant", ["dora", "tables"])
def test_peft_dora_and_table_adapters_match_hf_peft(variant, tmp_path):
    # PEFT's DoRA (its own magnitude path around our projections) and its Embedding / lm_head adapters (our loss
    # then forms logits): the same loss and adapter gradients as HF + PEFT.
    hf, ours = _pair("llama", tmp_path, tie_word_embeddings=False)
    kw = ({"use_dora": True, "target_modules": ALL_LINEAR["llama"]} if variant == "dora"
          else {"target_modules": ["q_proj", "embed_tokens", "lm_head"]})
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw)
    theirs, mine = peft.get_peft_model(hf, config), peft.get_peft_model(ours, config)
    _copy_adapters(theirs, mine)
    ids, labels = _batch()
    loss, ref = mine(input_ids=ids, labels=labels).loss, theirs(input_ids=ids, labels=labels).loss
    assert abs(loss.item() - ref.item()) <= FP32 * abs(ref.item())
    loss.backward()
    ref.backward()
    ref_params = dict(theirs.named_parameters())
    trained = {n: p for n, p in mine.named_parameters() if p.requires_grad}
    assert any(("magnitude" if variant == "dora" else "lora_embedding") in n for n in trained)
    for name, p in trained.items():
        assert max_rel(p.grad, ref_params[name].grad) < 1e-4, name


@pytest.mark.parametrize("family", sorted(TINY_MOE))
def test_peft_all_linear_on_a_moe_model_matches_hf_peft(family, tmp_path):
    """PEFT's all-linear on our Mixtral / Qwen3-MoE: attention linears, the routers and its target_parameters
    wrappers around the stacked experts (which parametrise gate_up_proj / down_proj for the duration of the experts'
    call; the block calls its experts module, so the wrappers see it) give HF + PEFT's loss and every adapter's
    gradient. lm_head is excluded by name: PEFT leaves out the output embedding only on transformers' own classes."""
    config, overrides = TINY_MOE[family]
    hf = build_hf(config, **overrides)
    hf.set_experts_implementation("eager")  # the per-expert loop: the path PEFT's wrappers are written for
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / family), dtype=torch.float32)
    ours_peft = peft.get_peft_model(ours, _lora("all-linear", init_lora_weights=False, exclude_modules=["lm_head"]))
    hf_peft = peft.get_peft_model(hf, _lora("all-linear", init_lora_weights=False))
    wrapped = {n.split(".lora_")[0].split("layers.0.")[-1] for n, _ in ours_peft.named_parameters()
               if "lora_" in n and "layers.0." in n}
    assert {"mlp.experts", "mlp.experts.base_layer", "mlp.gate"} <= wrapped
    _copy_adapters(hf_peft, ours_peft)
    _assert_same_step(ours_peft, hf_peft)
    ids, _ = _batch()
    # PEFT's save_pretrained of our wrapped model: HF + PEFT loads it with the same logits.
    ours_peft.save_pretrained(tmp_path / "adapter")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert max_rel(ours_peft.eval()(ids).logits, loaded(input_ids=ids).logits) < FP32


def test_peft_all_linear_takes_lm_head_unless_excluded(tmp_path):
    """What docs/ecosystem.md says: PEFT's "all-linear" leaves lm_head out only on transformers' classes, so on ours
    it adapts lm_head too; with exclude_modules=["lm_head"] it adapts exactly what it adapts on HF's model."""
    hf, ours = _pair("llama", tmp_path)

    def adapted(model, **kw):
        wrapped = peft.get_peft_model(model, _lora("all-linear", **kw))
        return {n.split(".lora_")[0].removeprefix("base_model.model.") for n, _ in wrapped.named_parameters()
                if "lora_" in n}

    theirs = adapted(hf)
    assert "lm_head" not in theirs
    assert adapted(AutoLigerForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32)) == theirs | {
        "lm_head"}
    assert adapted(ours, exclude_modules=["lm_head"]) == theirs


@pytest.mark.parametrize("native", [["q_proj"], ["lm_head"]], ids=["q_proj", "lm_head"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
def test_peft_over_native_adapters_is_refused_by_name(native, autocast, tmp_path):
    """get_peft_model("all-linear") on a model that already carries native adapters (liger_models.lora) wraps their
    lora_A / lora_B, plain nn.Linear, and freezes them; the fused paths read those weights without calling them, so
    PEFT's adapters were left out of the output, silently. Every path refuses it now, naming the wrapper: the
    packed projections, the lm_head's fused loss, and autocast's composed path."""
    from liger_models.lora import LoraSettings, add_lora

    _, ours = _pair("llama", tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=native, init=False))
    wrapped = peft.get_peft_model(ours, _lora("all-linear", init_lora_weights=False))
    assert any(name.endswith(".lora_A.lora_A.default") for name, _ in wrapped.named_modules())
    ids = torch.randint(0, 128, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(TypeError, match=r"lora_A is a peft\.tuners\.lora\.layer\.Linear: another library"):
            wrapped(input_ids=ids, labels=ids)
