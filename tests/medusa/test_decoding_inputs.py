"""medusa_generate's input checks and id types, as plain generate's (tests/models/test_generate_inputs.py): heads
built for another base, ids outside the vocabulary, a NaN temperature and EOS ids as numpy / tensor scalars."""

import numpy as np
import pytest
import torch

from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from tests.medusa._common import make_base

V, H = 37, 16


def test_heads_of_another_base_are_refused():
    # Heads for a smaller vocabulary ran silently: they can never propose the base's last ids, and their top-k
    # ranks index another vocabulary (MedusaModel refuses the pair; the function did not).
    heads = MedusaModel.from_base(make_base(V, H, torch.float64), num_heads=2).heads
    base = make_base(V + 4, H, torch.float64)
    with pytest.raises(ValueError, match="heads"):
        medusa_generate(base, heads, torch.randint(3, V, (1, 4)), 4)


@pytest.mark.parametrize("bad", [V, -1])
def test_ids_outside_the_vocabulary_are_named(bad):
    model = MedusaModel.from_base(make_base(V, H, torch.float64), num_heads=2)
    prompt = torch.randint(3, V, (1, 5))
    prompt[0, 2] = bad
    with pytest.raises(ValueError, match=rf"input_ids.*{bad}.*vocab_size.*{V}"):
        model.generate(prompt, 4)


def test_nan_temperature_is_refused():
    model = MedusaModel.from_base(make_base(V, H, torch.float64), num_heads=2)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.randint(3, V, (1, 4)), 4, temperature=float("nan"))


@pytest.mark.parametrize("wrap", [np.int64, torch.tensor], ids=["numpy", "0-d tensor"])
def test_eos_as_numpy_or_tensor_scalar_stops_like_plain_greedy(wrap):
    base = make_base(V, H, torch.float64, layers=2)
    model = MedusaModel.from_base(base, num_heads=2)
    prompt = torch.randint(3, V, (1, 4))
    eos = int(base.generate(prompt, max_new_tokens=10, eos_token_id=[])[0, 4 + 3])
    plain = base.generate(prompt, max_new_tokens=10, eos_token_id=eos)
    assert torch.equal(model.generate(prompt, 10, eos_token_id=wrap(eos)), plain)
