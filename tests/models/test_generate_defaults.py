"""generate's sampling defaults and filters as HF's generate applies them: generation_config.json's do_sample /
temperature / top_k / top_p / max_new_tokens / max_length, HF's global top_k = 50, and TopPLogitsWarper's boundary."""

import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from liger_models import LigerLlamaForCausalLM, LlamaConfig
from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from liger_models.modules.generate import sample_next

from .parity import build_hf, save_hf


def kept_by_hf(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None) -> torch.Tensor:
    """(B, V) bool: the tokens HF's warpers (temperature, top-k, top-p, in its order) leave a non-zero probability."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores)


@pytest.mark.parametrize("logits,top_p", [
    (torch.zeros(1, 4), 0.5),  # four equal tokens: HF keeps 2 (the mass after dropping 2 is exactly 1 − top_p)
    (torch.log(torch.tensor([[0.5, 0.25, 0.25]])), 0.5),  # HF keeps only the 0.5 token
], ids=["uniform", "half"])
def test_top_p_boundary_like_hf(logits, top_p):
    """A token is dropped when the mass of the tokens below it (its own included) is ≤ 1 − top_p, as HF's
    TopPLogitsWarper does; before, only when the mass above it was > top_p, which kept one token more here."""
    kept = kept_by_hf(logits, top_p=top_p)[0]
    gen = torch.Generator().manual_seed(0)
    drawn = sample_next(logits.repeat(400, 1), do_sample=True, top_p=top_p, generator=gen)
    assert set(drawn.tolist()) == set(kept.nonzero().flatten().tolist())


def test_sampling_filters_keep_the_tokens_hf_keeps():
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    for temperature, top_k, top_p in [(0.7, 20, 0.9), (1.3, None, 0.5), (1.0, 5, None), (0.5, None, 0.05)]:
        kept = kept_by_hf(logits, temperature, top_k, top_p)
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            drawn = sample_next(logits, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                generator=gen)
            assert kept.gather(1, drawn[:, None]).all()


def test_bad_filter_values_raise():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, do_sample=True, top_p=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        sample_next(logits, do_sample=True, top_k=-3)


def _instruct_like(tmp_path, **generation):
    """A tiny HF Llama whose generation_config.json carries sampling defaults (Llama 3 Instruct: do_sample true,
    temperature 0.6, top_p 0.9, max_length 4096), reloaded by HF and by us."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True)
    hf.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **generation)
    path = save_hf(hf, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return reference, LigerLlamaForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_generation_config_sampling_defaults_like_hf(tmp_path):
    """generate(ids) samples as the checkpoint says (HF's generate does); arguments win; greedy stays reachable."""
    hf, ours = _instruct_like(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, max_length=13)
    prompt = torch.randint(3, 128, (3, 5))
    for seed in range(3):  # same global seed → same draws (HF samples with torch's global generator)
        torch.manual_seed(seed)
        ref = hf.generate(prompt)
        torch.manual_seed(seed)
        assert torch.equal(ours.generate(prompt), ref), seed
    assert ref.shape[1] <= 13
    torch.manual_seed(7)
    ref = hf.generate(prompt, temperature=1.5, top_k=0, max_new_tokens=4)
    torch.manual_seed(7)
    assert torch.equal(ours.generate(prompt, temperature=1.5, top_k=0, max_new_tokens=4), ref)
    greedy = hf.generate(prompt, do_sample=False, max_new_tokens=6)
    assert torch.equal(ours.generate(prompt, do_sample=False, max_new_tokens=6), greedy)


def test_generation_config_max_new_tokens_and_too_short_max_length(tmp_path):
    hf, ours = _instruct_like(tmp_path, do_sample=False, max_new_tokens=3, max_length=6)
    prompt = torch.randint(3, 128, (1, 5))
    assert torch.equal(ours.generate(prompt, eos_token_id=[]), hf.generate(prompt, eos_token_id=[]))
    assert ours.generate(prompt, eos_token_id=[]).shape[1] == 5 + 3  # max_new_tokens wins over max_length
    heads = MedusaModel.from_base(ours, num_heads=2).heads  # Medusa decoding takes the same budget
    assert medusa_generate(ours, heads, prompt, eos_token_id=[]).shape[1] == 5 + 3
    assert ours.generate(prompt, np.int64(2), eos_token_id=[]).shape[1] == 5 + 2  # a numpy count is a count
    for bad in (0, -2):  # HF refuses a budget below 1; returning the prompt unchanged would hide the mistake
        with pytest.raises(ValueError, match="max_new_tokens"):
            hf.generate(prompt, max_new_tokens=bad)
        with pytest.raises(ValueError, match="max_new_tokens must be an integer ≥ 1"):
            ours.generate(prompt, max_new_tokens=bad)
        with pytest.raises(ValueError, match="max_new_tokens must be an integer ≥ 1"):
            medusa_generate(ours, heads, prompt, bad)
    ours.generation_config["max_new_tokens"] = 0
    with pytest.raises(ValueError, match="generation_config.json's max_new_tokens"):
        ours.generate(prompt)
    ours.generation_config.pop("max_new_tokens")
    with pytest.raises(ValueError, match="max_new_tokens"):  # max_length 6 leaves no room after 6 prompt tokens
        ours.generate(torch.randint(3, 128, (1, 6)))


def test_sampling_defaults_to_hf_top_k_50(tmp_path):
    """Without generation_config.json, sampling uses HF's global default top_k = 50 (top_k=0 turns it off)."""
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True)
    ours = LigerLlamaForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32)
    prompt = torch.randint(3, 128, (3, 5))
    kwargs = dict(do_sample=True, temperature=1.7, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
    for top_k in ({}, {"top_k": 0}):
        torch.manual_seed(3)
        ref = hf.generate(prompt, **kwargs, **top_k)
        torch.manual_seed(3)
        assert torch.equal(ours.generate(prompt, **kwargs, **top_k), ref), top_k


def test_greedy_is_still_the_default_without_sampling_config():
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    prompt = torch.randint(3, 128, (2, 4))
    first = model.generate(prompt, max_new_tokens=5, eos_token_id=[])
    assert first.shape == (2, 9) and torch.equal(model.generate(prompt, max_new_tokens=5, eos_token_id=[]), first)
    assert model.generate(prompt, eos_token_id=[]).shape == (2, 4 + 32)  # our default length without a config


def test_cache_preallocation_is_bounded(monkeypatch):
    """A budget from a checkpoint's max_length (4096, or 131072) must not preallocate that many KV slots up front
    when the answer may stop at an EOS after a few tokens: the cache starts small and grows by doubling."""
    from liger_models.modules import generate as generate_module

    capacities = []

    class RecordingCache(generate_module.KVCache):
        def __init__(self, capacity: int = 0) -> None:
            capacities.append(capacity)
            super().__init__(capacity)

    monkeypatch.setattr(generate_module, "KVCache", RecordingCache)
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    prompt = torch.randint(3, 128, (1, 4))
    first = int(model.generate(prompt, max_new_tokens=1, eos_token_id=[])[0, -1])
    out = model.generate(prompt, max_new_tokens=100_000, eos_token_id=first)  # stops after one token
    assert out.shape == (1, 5) and max(capacities) <= 4 + 4096  # was 4 + 100_000
