"""generate's input checks and id types: what HF's generate accepts (an EOS / pad id as a numpy integer or a 0-d
tensor) works here too, and bad input (ids outside the vocabulary, float ids, a NaN temperature) is a ValueError
that names the problem, not an IndexError from the embedding (a device-side assert on CUDA)."""

import numpy as np
import pytest
import torch

from liger_models import LigerLlamaForCausalLM, LlamaConfig

V = 40


def _tiny(seed: int = 0) -> LigerLlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig.tiny(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                              num_key_value_heads=1, num_hidden_layers=1, initializer_range=0.3)
    return LigerLlamaForCausalLM.from_config(config, dtype=torch.float64)


@pytest.mark.parametrize("wrap", [np.int64, torch.tensor], ids=["numpy", "0-d tensor"])
def test_eos_and_pad_ids_as_numpy_or_tensor_scalars(wrap):
    # HF's generate turns any of these into a tensor; before, a numpy id or a 0-d tensor was a TypeError
    # ("object is not iterable") from the EOS helper.
    model = _tiny(1)
    prompt = torch.randint(3, V, (2, 5))
    free = model.generate(prompt, max_new_tokens=10, eos_token_id=[])
    eos = int(free[0, 5 + 2])  # row 0 stops at its third new token, row 1 whenever (or never)
    ref = model.generate(prompt, max_new_tokens=10, eos_token_id=eos, pad_token_id=7)
    assert ref.shape[1] < 5 + 10 or bool((ref[0, 5 + 3:] == 7).all())
    assert torch.equal(model.generate(prompt, max_new_tokens=10, eos_token_id=wrap(eos), pad_token_id=wrap(7)), ref)
    assert torch.equal(model.generate(prompt, max_new_tokens=10, eos_token_id=torch.tensor([eos, V + 5]),
                                      pad_token_id=7), ref)


@pytest.mark.parametrize("bad", [V, V + 3, -1])
def test_ids_outside_the_vocabulary_are_named(bad):
    model = _tiny()
    prompt = torch.randint(3, V, (2, 6))
    prompt[1, 4] = bad
    with pytest.raises(ValueError, match=rf"input_ids.*{bad}.*vocab_size.*{V}"):
        model.generate(prompt, max_new_tokens=3)


def test_float_ids_and_nan_temperature_are_named():
    model = _tiny()
    prompt = torch.randint(3, V, (1, 4))
    with pytest.raises(ValueError, match="input_ids must be int64"):
        model.generate(prompt.float(), max_new_tokens=3)
    with pytest.raises(ValueError, match="temperature"):  # NaN > 0 is False: it passed and NaN probs raised later
        model.generate(prompt, max_new_tokens=3, do_sample=True, temperature=float("nan"))
