"""A batch's tree cut to a token budget per verification call (medusa/tree.py `tree_for_batch`): which choices stay,
that every cut is a tree, and that decoding verifies the cut tree with output still equal to plain generate's."""

import pytest
import torch

from liger_models.medusa import decoding
from liger_models.medusa.decoding import dense_medusa_choices, medusa_generate
from liger_models.medusa.tree import TREE_TOKENS, choice_cost, default_medusa_choices, tree_for_batch
from tests.medusa.test_batched_decoding import WIDTHS, RowOracleHeads, _rows_alone
from tests.models.test_graphed_decoding import _mistral
from tests.models.test_inference import left_padded


def _closed(tree) -> bool:
    return all(len(c) == 1 or c[:-1] in tree for c in tree)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5])
def test_the_default_tree_lists_parents_first_most_promising_first(num_heads):
    tree = default_medusa_choices(num_heads)
    assert set(tree) == set(dense_medusa_choices([4, 2, 2, 1][:num_heads])) and len(set(tree)) == len(tree)
    assert all(_closed(set(tree[:k])) for k in range(1, len(tree) + 1))
    costs = [choice_cost(c) for c in tree]
    assert tree[0] == (0,) and costs == sorted(costs)
    if num_heads >= 2:  # as in Medusa's published tree: a second head at rank 0 before the first head's rank 1
        assert tree[:4] == [(0,), (0, 0), (1,), (0, 1)]
    if num_heads >= 3:  # and a third head's rank 0 after the first head's rank 2
        assert tree.index((2,)) < tree.index((0, 0, 0)) < tree.index((3,))


def test_choice_cost_grows_along_every_path():
    for choice in [(0,), (3, 1), (0, 0, 0, 0, 0, 0), (9, 9, 9)]:
        assert all(choice_cost(choice[:k]) < choice_cost(choice[: k + 1]) for k in range(1, len(choice)))


@pytest.mark.parametrize("batch,nodes", [(1, 44), (2, 44), (3, 31), (4, 23), (8, 11), (16, 5), (47, 1), (500, 1)])
def test_the_default_tree_is_cut_to_the_token_budget(batch, nodes):
    tree = default_medusa_choices(5)
    cut = tree_for_batch(tree, batch)
    assert len(cut) == nodes and batch * (len(cut) + 1) <= max(TREE_TOKENS, 2 * batch)
    assert cut == tree[:nodes]  # the list's head: parents come first, so no choice was skipped
    assert tree_for_batch(tree, batch, tree_tokens=None) == tree == tree_for_batch(tree, batch, tree_tokens=0)


def test_a_choice_whose_parent_was_cut_is_skipped():
    # A list in another order than parents-first (a user's own): the cut keeps a tree, taking choices in order.
    tree = [(1,), (1, 0, 0), (0,), (1, 0), (1, 1), (1, 0)]
    assert tree_for_batch(tree, 1, tree_tokens=4) == [(1,), (0,), (1, 0)]
    assert tree_for_batch(tree, 1, tree_tokens=5) == [(1,), (0,), (1, 0), (1, 1)]  # the repeated (1, 0) once
    assert tree_for_batch(tree, 1, tree_tokens=100) == tree  # fits: verified as given
    with pytest.raises(ValueError, match="at least one row"):
        tree_for_batch(tree, 0)
    with pytest.raises(ValueError, match=">= 0"):
        tree_for_batch(tree, 1, tree_tokens=-1)


@pytest.mark.parametrize("tree_tokens,choices", [(30, 9), (0, 21)])
def test_decoding_verifies_the_cut_tree_with_plain_output(monkeypatch, tree_tokens, choices):
    # Three rows under the dense [3, 2, 2] tree (21 choices, 66 tokens a call): a 30-token budget cuts it to 9
    # choices, 0 keeps it whole. Oracle heads put every true token inside the whole tree's ranks, so the whole tree
    # accepts all three heads' guesses at each step, and the cut one fewer wherever it lost the branch.
    verified = []
    real = decoding.generate_medusa_buffers
    monkeypatch.setattr(decoding, "generate_medusa_buffers", lambda c, *a: verified.append(list(c)) or real(c, *a))
    base = _mistral(None)
    ids, mask = left_padded(3, 6, [0, 2, 4])
    plain = base.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    heads = RowOracleHeads(base, _rows_alone(base, ids, mask, 16))
    full = dense_medusa_choices(WIDTHS)
    out, steps = medusa_generate(base, heads, ids, 16, attention_mask=mask, topk=3, return_stats=True,
                                 medusa_choices=full, eos_token_id=[], tree_tokens=tree_tokens)
    assert torch.equal(out, plain) and [sum(s) for s in steps] == [16] * 3
    assert verified[0] == full and len(verified[-1]) == choices and _closed(set(map(tuple, verified[-1])))
    assert verified[-1] == tree_for_batch(full, 3, tree_tokens)
    depth = max(len(c) for c in verified[-1])
    assert max(max(s) for s in steps) <= 1 + depth
    if choices == len(full):
        assert all(max(s) == 4 for s in steps)
