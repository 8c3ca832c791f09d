"""Medusa rules each pinned by one exact case: stage 1 drops the base term whatever the config says, stage 2 saves
the heads where they end up, a heads config's "version" read as a string or a number, config sizes that disagree
with the heads file refused, the typical-acceptance rule and its tie-break token for token."""

import json
import os

import pytest
import torch

from liger_models.medusa import MedusaConfig, MedusaModel
from tests.helpers import assert_matches
from tests.medusa._common import accept_paths as _accept, make_base, packed_batch

V, H = 37, 16


def _randomised(model):
    # Off the zero init, so every head has its own non-trivial CE.
    for p in model.heads.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    return model


def test_stage1_drops_the_base_term_even_when_the_config_sets_a_weight():
    """Stage 1 freezes the base, so w0 is 0 whatever `base_loss_weight` says (MedusaConfig docstring): the loss must
    be exactly the heads' terms, the same as a stage-1 model whose config leaves the weight unset."""
    base = make_base(V, H)
    weighted = _randomised(MedusaModel.from_base(base, stage=1, num_heads=2, base_loss_weight=0.7))
    plain = MedusaModel(base, weighted.heads, stage=1)
    plain.config = MedusaConfig(**{**weighted.config.__dict__, "base_loss_weight": None})
    assert weighted.base_loss_weight == 0.0
    ids, labels, pos = packed_batch(2, 10, V, packed=True)
    out = weighted(ids, labels=labels, position_ids=pos)
    ref = plain(ids, labels=labels, position_ids=pos)
    assert out.base_loss is None
    # The base CE on random weights is O(log V): a leaked 0.7·CE_0 would move the loss far past this tolerance.
    assert_matches(out.loss.detach(), ref.loss.detach().double(), name="stage-1 loss")
    heads_only = sum(s * ce for s, ce in zip(weighted.head_scales(), out.head_losses.double()))
    assert_matches(out.loss.detach(), heads_only, name="loss = Σ λ_k CE_k")


def test_stage2_save_points_the_heads_at_the_final_location(tmp_path):
    """An atomic checkpoint writes into a staging directory and renames it: the heads' base_model_name_or_path must
    name where the files will live (`location`), not the staging directory that is about to disappear."""
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2)
    staging, final = tmp_path / "staging", tmp_path / "final"
    model.save_pretrained(str(staging), location=str(final))
    cfg = json.loads((staging / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == os.path.abspath(final)
    model.save_pretrained(str(tmp_path / "plain"))
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == os.path.abspath(tmp_path / "plain")


@pytest.mark.parametrize("version,shared", [(2, True), ("2", True), (1, False), ("1", False)])
def test_version_read_as_string_or_number(version, shared):
    """A hand-written or re-serialised config.json may hold `"version": 2` as a number; it means the same thing."""
    cfg = MedusaConfig.from_json_dict({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": version})
    assert cfg.share_lm_head is shared


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size"])
def test_config_sizes_that_disagree_with_the_heads_file_raise(tmp_path, field):
    """config.json's hidden_size / vocab_size describe the tensors: a mismatch is a broken checkpoint, named as such
    instead of loading heads that silently claim another width."""
    model = MedusaModel.from_base(make_base(V, H), num_heads=2)
    model.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: cfg[field] + 1}))
    with pytest.raises(ValueError, match=field):
        MedusaModel.from_pretrained(str(tmp_path), base=model.base)


def _reference_accept(paths, valid, logits, temperature, eps, alpha):
    """Typical acceptance (docs/medusa.md#tree-decoding) in float64, one token at a time: accept while
    p(x) > min(ε, δ·exp(−H(p))) at temperature T; the longest prefix wins, ties by the summed log-probability of the
    accepted tokens, then the first row. Also returns the smallest |p − threshold| seen, to skip draws that rounding
    could flip."""
    P, D = paths.shape[0], paths.shape[1] - 1
    best, margin = (0, 0, -float("inf")), float("inf")
    for p in range(P):
        n, score = 0, 0.0
        for d in range(D):
            if not valid[p, d + 1]:
                break
            logp = torch.log_softmax(logits[p, d].double() / temperature, -1)
            entropy = -(logp.exp() * logp).sum()
            threshold = min(eps, alpha * float(torch.exp(-entropy)))
            prob = float(logp[paths[p, d + 1]].exp())
            margin = min(margin, abs(prob - threshold))
            if prob <= threshold:
                break
            n, score = n + 1, score + float(logp[paths[p, d + 1]])
        if n > best[1] or (n == best[1] and n > 0 and score > best[2]):
            best = (p, n, score)
    return best[0], best[1], margin


def test_typical_acceptance_matches_the_rule_token_for_token():
    """Random small-vocabulary draws (so probabilities sit near ε and δ·exp(−H)) against a direct float64 reading
    of the rule: the threshold's min (not max), the entropy's sign, the temperature, and a tie-break that sums only
    the accepted tokens' log-probabilities all change the answer on some draw."""
    checked = partial = 0
    for _ in range(400):
        P, D, vocab = 4, 3, 6
        temperature = float(torch.empty(()).uniform_(0.4, 2.0))
        eps, alpha = float(torch.empty(()).uniform_(0.05, 0.3)), float(torch.empty(()).uniform_(0.2, 0.9))
        logits = torch.randn(P, D + 1, vocab) * float(torch.empty(()).uniform_(0.5, 3.0))
        paths = torch.randint(0, vocab, (P, D + 1))
        valid = torch.ones(P, D + 1, dtype=torch.bool)
        valid[torch.randint(0, P, ()), D] = False  # a shorter path, padded as retrieve_indices pads it
        row, n, margin = _reference_accept(paths, valid, logits, temperature, eps, alpha)
        if margin < 1e-5:  # float32 vs float64 could disagree on this draw
            continue
        checked += 1
        assert _accept(paths, valid, logits, temperature, eps, alpha) == (row, n)
        partial += 0 < n < D  # a rejected tail exists: where the tie-break's sum must stop
    assert checked > 300 and partial > 50  # partial prefixes (and their tie-breaks) were really exercised


def test_tie_break_ignores_the_rejected_tail():
    """Two rows accept one token each; row 0's accepted token is more likely, row 1's rejected second token is
    far more likely than row 0's. The winner is decided by the accepted prefix only."""
    vocab = 4
    logits = torch.full((2, 3, vocab), 0.0)
    logits[:, 0] = torch.tensor([3.0, 2.0, -9.0, -9.0])  # p(token 0) > p(token 1), both above the threshold
    logits[:, 1] = torch.tensor([-9.0, -9.0, 0.0, 0.0])  # p = 0.5 for tokens 2 and 3; never for 0 and 1
    paths = torch.tensor([[0, 0, 0], [0, 1, 1]])  # root, first candidate, second candidate (both rejected: p≈0)
    logits[0, 1, 0] = -30.0  # row 0's rejected tail: far less likely than row 1's
    logits[1, 1, 1] = -12.0
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert _accept(paths, valid, logits, 1.0, 0.09, 0.3) == (0, 1)
