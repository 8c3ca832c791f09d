"""Medusa trees fitted to trained heads (medusa/calibrate.py, tree.tree_from_rank_paths): the rank paths predict
exactly what greedy decoding accepts, the fitted tree is the best one of its size, and it travels with the heads."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from liger_models.medusa import MedusaModel
from liger_models.medusa.calibrate import (CHOICES_NAME, calibrate_medusa_choices, load_medusa_choices, rank_paths,
                                           save_medusa_choices)
from liger_models.medusa.decoding import medusa_generate
from liger_models.medusa.tree import (MISS, default_medusa_choices, mean_accepted, prefix_counts, tree_for_batch,
                                     tree_from_rank_paths, walk_steps, walk_tokens_per_step)
from tests.medusa._common import make_base

V, H = 37, 16


def _longest_in_tree(path: list[int], tree: set) -> int:
    n = 0
    while n < len(path) and path[n] != MISS and tuple(path[: n + 1]) in tree:
        n += 1
    return n


def test_prefix_counts_stop_at_the_first_miss():
    paths = torch.tensor([[0, 1, 2], [0, 1, MISS], [0, MISS, 0], [3, 0, 0]])
    counts = prefix_counts(paths)
    assert counts == {(0,): 3, (0, 1): 2, (0, 1, 2): 1, (3,): 1, (3, 0): 1, (3, 0, 0): 1}
    assert mean_accepted([(0,), (0, 1), (3,)], paths) == (3 + 2 + 1) / 4


def _closed(tree) -> bool:
    return all(c[:-1] in tree for c in tree if len(c) > 1)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_fitted_tree_is_the_best_of_its_size(size):
    # Brute force over every closed tree of at most k choices among those any path reaches, for the fitted tree and
    # for each of its prefixes (listed most-counted first, so that tree_for_batch's cut is the best smaller tree).
    paths = torch.randint(0, 3, (40, 3))
    paths[torch.rand(40, 3) < 0.3] = MISS
    fitted = tree_from_rank_paths(paths, size)
    counts = prefix_counts(paths)
    assert len(fitted) <= size and len(set(fitted)) == len(fitted)
    assert [counts[c] for c in fitted] == sorted((counts[c] for c in fitted), reverse=True)
    for k in range(1, len(fitted) + 1):
        prefix = fitted[:k]
        best = max(sum(counts[c] for c in subset) for n in range(1, k + 1)
                   for subset in itertools.combinations(counts, n) if _closed(set(subset)))
        assert _closed(set(prefix)) and sum(counts[c] for c in prefix) == best, k
        assert tree_for_batch(fitted, batch=1, tree_tokens=k + 1) == prefix
    assert mean_accepted(fitted, paths) == sum(counts[c] for c in fitted) / len(paths)


def test_no_hits_give_the_one_node_tree_and_a_size_is_needed():
    assert tree_from_rank_paths(torch.full((5, 2), MISS), 10) == [(0,)]
    with pytest.raises(ValueError, match="at least one choice"):
        tree_from_rank_paths(torch.zeros(2, 2, dtype=torch.long), 0)


@pytest.mark.parametrize("choices", ["default", "fitted"])
def test_rank_paths_predict_every_greedy_step(choices):
    # Decoding a greedy continuation, each step starting after position p accepts exactly the longest prefix of
    # rank path p that lies in the tree: the paths measure what decoding checks.
    base = make_base(V, H, torch.float64, layers=2)
    heads = MedusaModel.from_base(base, num_heads=3).heads
    prompt = torch.randint(3, V, (1, 5))
    budget = 40
    sequence = base.generate(prompt, budget, eos_token_id=[], do_sample=False)[0]
    paths = rank_paths(base, heads, sequence, start=5)
    assert paths.shape == (len(sequence) - 1 - 3 - 4, 3) and (paths >= MISS).all() and (paths < 10).all()
    tree = default_medusa_choices(3) if choices == "default" else tree_from_rank_paths(paths, 12)
    out, steps = medusa_generate(base, heads, prompt, budget, medusa_choices=tree, eos_token_id=[],
                                 return_stats=True)
    assert torch.equal(out[0], sequence)
    last, checked, in_tree = 4, 0, set(map(tuple, tree))
    for emitted in steps:
        if last - 4 >= len(paths) or last + 1 + 3 + 1 > budget + 5:  # past the ranked positions or the budget's cut
            break
        assert emitted == 1 + _longest_in_tree(paths[last - 4].tolist(), in_tree)
        last += emitted
        checked += 1
    assert checked >= 5
    # The walk over the paths is that decoding, step for step, up to where the ranked rows end.
    walked = walk_steps(tree, paths)
    assert walked[:-1] == steps[: len(walked) - 1] and walked[-1] <= steps[len(walked) - 1]
    assert walk_tokens_per_step(tree, [paths]) == sum(walked) / len(walked)


def test_the_walk_scores_what_the_row_mean_overstates():
    # Rows 0-2 accept 2 tokens each, rows 3-9 none. Every-row mean: 1 + 6/10; decoding starts at row 0, emits 3
    # tokens, lands on row 3, then emits one per step: 10 tokens in 8 steps.
    paths = torch.full((10, 2), MISS)
    paths[:3] = 0
    assert 1 + mean_accepted([(0,), (0, 0)], paths) == pytest.approx(1.6)
    assert walk_steps([(0,), (0, 0)], paths) == [3] + [1] * 7
    assert walk_tokens_per_step([(0,), (0, 0)], [paths, paths[3:]]) == (10 + 7) / (8 + 7)


def test_calibration_keeps_the_default_tree_when_it_does_better(monkeypatch):
    base = make_base(V, H, torch.float64)
    base.config.eos_token_id = None
    heads = MedusaModel.from_base(base, num_heads=2).heads
    prompts = [torch.randint(3, V, (5,))]
    # Paths the default tree scores well on and a rank-9 tree never: random heads rank the targets near uniformly,
    # so which of the two hits more on a short continuation was the seed's choice (seed 13: rank 9 once, 0-3 never).
    paths = torch.tensor([[3, 1]] * 24)  # head 1's fourth guess, then head 2's second: the default tree's last choice
    monkeypatch.setattr("liger_models.medusa.calibrate.rank_paths", lambda *args: paths)
    monkeypatch.setattr("liger_models.medusa.calibrate.tree_from_rank_paths", lambda paths, size: [(9,)])
    kept = calibrate_medusa_choices(base, heads, prompts, new_tokens=24, size=20)
    assert kept.kept_default and kept.medusa_choices == default_medusa_choices(2)
    assert kept.tokens_per_step == kept.default_tokens_per_step > 1.0
    small = calibrate_medusa_choices(base, heads, prompts, new_tokens=24, size=1)  # the default does not fit in 1
    assert not small.kept_default and small.medusa_choices == [(9,)]
    # The kept default tree as batches cut it (13 nodes: whole up to 4 rows, then 12 without (3, 1), 6 without (3,)),
    # walked on the same paths: 3 tokens a step, then 2, then 1.
    assert {b: (n, t) for b, (n, t) in kept.by_batch.items()} == {1: (13, 3.0), 2: (13, 3.0), 4: (13, 3.0),
                                                                   8: (12, 2.0), 16: (6, 1.0)}


def test_continuations_too_short_to_rank():
    base = make_base(V, H, torch.float64)
    heads = MedusaModel.from_base(base, num_heads=3).heads
    for length in (1, 4, 7):  # last committed positions 3 … length − 5 (p + 1 + 3 heads must be a position): none
        assert rank_paths(base, heads, torch.randint(0, V, (length,)), start=4).shape == (0, 3)
    assert rank_paths(base, heads, torch.randint(0, V, (8,)), start=4).shape == (1, 3)
    eos = int(base.generate(torch.tensor([[5, 6]]), 1, eos_token_id=[])[0, -1])  # every continuation ends at once
    with pytest.raises(ValueError, match="too short"):
        calibrate_medusa_choices(base, heads, [torch.tensor([5, 6])], new_tokens=1)
    base.config.eos_token_id = eos
    with pytest.raises(ValueError, match="too short"):
        calibrate_medusa_choices(base, heads, [torch.tensor([5, 6])], new_tokens=30)


def test_rank_paths_against_a_materialised_reference():
    base = make_base(V, H, torch.float64)
    heads = MedusaModel.from_base(base, num_heads=2).heads
    sequence = torch.randint(0, V, (12,))
    paths = rank_paths(base, heads, sequence, start=3, topk=4)
    hidden = base.model(sequence[None])[0]
    for row, p in enumerate(range(2, 12 - 1 - 2)):
        for d in (1, 2):
            order = heads.logits(hidden[p: p + 1], 2)[d - 1, 0].argsort(descending=True)[:4].tolist()
            target = int(sequence[p + 1 + d])
            assert int(paths[row, d - 1]) == (order.index(target) if target in order else MISS)


def test_calibration_saves_a_tree_that_generate_uses(tmp_path, monkeypatch):
    base = make_base(V, H, torch.float64)
    base.config.eos_token_id = None  # a random model could end both continuations at once (tested above)
    medusa = MedusaModel.from_base(base, num_heads=3)
    prompts = [torch.randint(3, V, (n,)) for n in (4, 6)]
    calibration = calibrate_medusa_choices(base, medusa.heads, prompts, new_tokens=20, size=9)
    assert 1 <= len(calibration.medusa_choices) <= 9 and calibration.positions > 0
    assert calibration.tokens_per_step >= 1.0 and calibration.default_tokens_per_step >= 1.0
    medusa.save_pretrained(str(tmp_path))
    assert MedusaModel.from_pretrained(str(tmp_path), base=base).medusa_choices is None  # none saved yet
    save_medusa_choices(tmp_path, calibration)
    loaded = MedusaModel.from_pretrained(str(tmp_path), base=base)
    assert loaded.medusa_choices == calibration.medusa_choices
    seen = []
    monkeypatch.setattr("liger_models.medusa.model.medusa_generate", lambda *a, **k: seen.append(k["medusa_choices"]))
    loaded.generate(prompts[0][None], 4)
    loaded.generate(prompts[0][None], 4, medusa_choices=[(0,)])  # an explicit tree wins
    assert seen == [calibration.medusa_choices, [(0,)]]


def test_a_bare_list_of_choices_loads(tmp_path):
    (tmp_path / CHOICES_NAME).write_text("[[0], [1], [0, 0]]")
    assert load_medusa_choices(tmp_path, num_heads=2) == [(0,), (1,), (0, 0)]


@pytest.mark.parametrize("content, match", [({"medusa_choices": [[0], [0, 0, 0, 0]]}, "only 3 Medusa heads"),
                                            ({"medusa_choices": [[0], [10]]}, r"\[0, 10\)"),
                                            ({"medusa_choices": [[1, 0]]}, "parent"),
                                            ({"medusa_choices": "[[0]]"}, "list of rank paths"),
                                            ({}, "list of rank paths"),
                                            ("[[0], [1]", "is not JSON")])
def test_a_tree_that_does_not_fit_is_refused_by_name(content, match, tmp_path):
    (tmp_path / CHOICES_NAME).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        load_medusa_choices(tmp_path, num_heads=3)
    assert CHOICES_NAME in str(info.value)
