"""Medusa decoding of a prompt that holds the pad id: as plain generate does (HF infers an attention_mask from the pad
id), those tokens are padding and hidden, unless an all-ones attention_mask says they are text. A padded prompt
decodes through the per-row steps (medusa/batched_steps.py), like several prompts."""

import pytest
import torch

from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from tests.medusa._common import make_base

V, H = 37, 16


def _echo_model(base):
    model = MedusaModel.from_base(base, num_heads=2)
    for k in range(2):  # heads that echo the base's next-token guess: accepted whenever the text repeats
        model.heads[k][0].linear.bias.data.zero_()
    return model


@pytest.mark.parametrize("where", ["left-padded", "inside", "last"])  # last: HF's positions restart after it
def test_prompt_with_pad_id_decodes_like_plain_generate(where):
    base = make_base(V, H, torch.float64, layers=2)  # config pad_token_id 0, eos 2
    model = _echo_model(base)
    prompt = torch.randint(3, V, (1, 6))
    if where == "left-padded":
        prompt[0, :2] = 0
    else:
        prompt[0, 3 if where == "inside" else -1] = 0
    for mask in (None, (prompt != 0).long()):  # the pad id inferred, or the same mask given
        plain = base.generate(prompt, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
        out, steps = model.generate(prompt, 12, eos_token_id=[], attention_mask=mask, return_stats=True)
        # one sequence: one flat list of tokens per step, as for an unpadded prompt
        assert torch.equal(out, plain) and all(isinstance(n, int) for n in steps) and sum(steps) == 12
    if where == "left-padded":  # the padded prompt continues as its unpadded tokens do alone
        assert torch.equal(out[:, 2:], base.generate(prompt[:, 2:], max_new_tokens=12, eos_token_id=[]))
    # An all-ones mask says the pad ids are real text: the same tokens as plain greedy with that mask.
    ones = torch.ones_like(prompt)
    plain = base.generate(prompt, attention_mask=ones, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(medusa_generate(base, model.heads, prompt, 8, eos_token_id=[], attention_mask=ones), plain)
    # A pad id the caller names explicitly, and none at all (an EOS id as pad is never inferred, as in HF).
    named = prompt.masked_fill(prompt == 0, 5)
    plain = base.generate(named, max_new_tokens=8, eos_token_id=[], pad_token_id=5)
    assert torch.equal(medusa_generate(base, model.heads, named, 8, eos_token_id=[], pad_token_id=5), plain)
    base.config.pad_token_id = None
    plain = base.generate(prompt, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(medusa_generate(base, model.heads, prompt, 8, eos_token_id=[]), plain)
