"""PEFT's layers_to_transform: adapters on the targets of some decoder layers only. Adapters saved so move between
ours and HF + PEFT with the same modules adapted and the same logits (fp32, judged by float64 HF + PEFT as in
test_peft_format); what PEFT would leave without an adapter is refused by name."""

from __future__ import annotations

import copy
import json

import pytest

from liger_models.lora import LoraSettings, add_lora, load_adapter, lora_modules, save_adapter
from liger_models.lora.config import layer_index, parse_indices

from .common import batch, pair
from .test_peft_format import assert_same_logits

peft = pytest.importorskip("peft")
LAYERS = 4


def adapted_by_peft(model) -> set[str]:
    """The module names HF + PEFT put a LoRA adapter on, as our names (PEFT's prefix off)."""
    prefix = "base_model.model."
    return {name[len(prefix):] for name, module in model.named_modules()
            if hasattr(module, "lora_A") and "default" in module.lora_A}


@pytest.mark.parametrize("layers, pattern", [([0, 2], None), (3, "layers"), ([1, 2, 3], ["layers"])])
def test_a_peft_adapter_on_some_layers_loads_here_with_the_same_logits(layers, pattern, tmp_path):
    hf, ours, _ = pair("llama", tmp_path, num_hidden_layers=LAYERS)
    clean = copy.deepcopy(hf)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             layers_to_transform=layers, layers_pattern=pattern, init_lora_weights=False)
    trained = peft.get_peft_model(hf, config)
    trained.save_pretrained(tmp_path / "hf_adapter")
    names = load_adapter(ours, tmp_path / "hf_adapter")
    wanted = {layers} if isinstance(layers, int) else set(layers)
    assert set(names) == set(lora_modules(ours)) == adapted_by_peft(trained)
    assert {layer_index(n) for n in names} == wanted and len(names) == 3 * len(wanted)
    assert_same_logits(ours, trained, clean, batch()[0], tmp_path)


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3"])
def test_our_adapter_on_some_layers_loads_in_hf_peft_with_the_same_logits(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path, num_hidden_layers=LAYERS)
    clean = copy.deepcopy(hf)
    names = add_lora(ours, LoraSettings(r=4, alpha=8, init=False, layers_to_transform=[3, 1]))
    assert {layer_index(n) for n in names} == {1, 3}
    assert len(names) == len([n for n in lora_modules(ours)]) and all(".layers.0." not in n for n in names)
    save_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1, 3] and isinstance(config["target_modules"], list)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert adapted_by_peft(loaded) == set(names)
    assert_same_logits(ours, loaded, clean, batch()[0], tmp_path)


def test_what_layers_to_transform_cannot_honour_is_refused(tmp_path):
    _, ours, _ = pair("llama", tmp_path, num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match=r"layers_to_transform names layer 4, but this model has 4 decoder layers"):
        add_lora(ours, LoraSettings(layers_to_transform=[1, 4]))
    with pytest.raises(ValueError, match=r"lm_head.*outside the decoder layers"):
        add_lora(ours, LoraSettings(targets=["q_proj", "lm_head"], layers_to_transform=[0]))
    with pytest.raises(ValueError, match=r"the pattern .* selects the layers itself"):
        LoraSettings(targets=r".*\.q_proj", layers_to_transform=[0])
    with pytest.raises(ValueError, match=r"decoder layer indices"):
        LoraSettings(layers_to_transform=[-1])
    assert not lora_modules(ours)  # nothing half-attached by a refused call
    assert LoraSettings(layers_to_transform=[]).layers_to_transform is None  # PEFT: an empty list is every layer

    hf, _, _ = pair("llama", tmp_path / "other", num_hidden_layers=LAYERS)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[0])) \
        .save_pretrained(tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "layers_pattern": "h"}))
    with pytest.raises(ValueError, match=r"layers_pattern='h' is not supported"):
        load_adapter(ours, tmp_path / "adapter")


def test_moe_parameters_beside_layers_to_transform_are_refused(tmp_path):
    from liger_models import AutoLigerForCausalLM, Qwen3MoeConfig

    model = AutoLigerForCausalLM.from_config(Qwen3MoeConfig.tiny())
    with pytest.raises(ValueError, match=r"target_parameters adapt every layer"):
        add_lora(model, LoraSettings(layers_to_transform=[0]))
    names = add_lora(model, LoraSettings(targets=["q_proj", "o_proj"], layers_to_transform=[0]))
    assert names and {layer_index(n) for n in names} == {0}


def test_layer_lists_parse_as_indices_and_ranges():
    assert parse_indices("0-3, 7,5") == [0, 1, 2, 3, 5, 7]
    assert parse_indices("4") == [4]
    for bad in ("a", "3-1", "1,,2", "-1", ""):
        with pytest.raises(ValueError, match="is not a layer index or a range"):
            parse_indices(bad)
