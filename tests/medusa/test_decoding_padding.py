"""Medusa decoding of a prompt that holds the pad id: plain generate would hide those tokens (HF infers an
attention_mask from the pad id), tree decoding decodes one unpadded sequence, so it refuses instead of diverging."""

import pytest
import torch

from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from tests.medusa._common import make_base

V, H = 37, 16


@pytest.mark.parametrize("where", ["left-padded", "inside"])
def test_prompt_with_pad_id_is_refused_unless_marked_real(where):
    base = make_base(V, H, torch.float64, layers=2)  # config pad_token_id 0, eos 2
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompt = torch.randint(3, V, (1, 6))
    if where == "left-padded":
        prompt[0, :2] = 0
    else:
        prompt[0, 3] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        medusa_generate(base, heads, prompt, 8, eos_token_id=[])
    with pytest.raises(ValueError, match="padding"):  # an explicit mask with zeros is padding too
        medusa_generate(base, heads, prompt, 8, eos_token_id=[], attention_mask=(prompt != 0).long())
    # An all-ones mask says the pad ids are real text: the same tokens as plain greedy with that mask.
    ones = torch.ones_like(prompt)
    plain = base.generate(prompt, attention_mask=ones, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(medusa_generate(base, heads, prompt, 8, eos_token_id=[], attention_mask=ones), plain)
    # A pad id the caller names explicitly, and none at all (an EOS id as pad is never inferred, as in HF).
    with pytest.raises(ValueError, match="attention_mask"):
        medusa_generate(base, heads, prompt.masked_fill(prompt == 0, 5), 8, eos_token_id=[], pad_token_id=5)
    base.config.pad_token_id = None
    plain = base.generate(prompt, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(medusa_generate(base, heads, prompt, 8, eos_token_id=[]), plain)
