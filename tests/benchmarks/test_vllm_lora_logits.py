"""benchmarks/tools/vllm_lora_logits.py's save half (its check half needs vLLM, no test dependency): the base
checkpoint and adapter it writes, loaded by transformers and PEFT, give the logits it records for vLLM to match,
with and without the adapter."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import vllm_lora_logits  # noqa: E402


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe", "gemma3_multimodal"])
def test_recorded_logits_are_transformers_and_peft_s(family, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    vllm_lora_logits.save(tmp_path, [family])
    directory = tmp_path / family
    expected = load_file(str(directory / "expected.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        base = model(expected["ids"]).logits
    adapted_model = peft.PeftModel.from_pretrained(model, directory / "adapter")
    with torch.no_grad():
        adapted = adapted_model(expected["ids"]).logits
    torch.testing.assert_close(base, expected["base"], rtol=0, atol=1e-5)
    torch.testing.assert_close(adapted, expected["adapted"], rtol=0, atol=1e-5)
    assert (expected["adapted"] - expected["base"]).abs().max() > 1e-2  # the adapter changes what vLLM must match
    for key in ("adapted", "base"):  # the float64 forward vLLM's error is judged against: the same function
        exact = expected[f"{key}_exact"]
        assert exact.dtype == torch.float64
        assert (expected[key].double() - exact).abs().max() <= 1e-5 * exact.abs().max()
