"""A Medusa tree fitted to trained heads: measure where their top-k holds the base model's own greedy tokens, then
keep the choices that would have been accepted most often (`tree.tree_from_rank_paths`).

Why the base's greedy continuations and not the data: greedy acceptance compares each candidate with the base's
argmax after the accepted tokens, so the rank a head must hit is that of the base's greedy token. Along a greedy
continuation every token is that argmax, so a teacher-forced pass over it sees what each decoding step would check
(`rank_paths`; exactly in fp32 / fp64, while in bf16 the cached and the full-sequence forward may round a near-tied
argmax apart). The tree is fitted on every position (`tree_from_rank_paths`); it and the default tree are then
scored as decoding runs, a step starting where the previous one ended (`walk_tokens_per_step`), and the default is
kept when it does as well. The kept tree is also walked as decoding cuts it for batches of 1-16 rows
(`tree.tree_for_batch`), so a user sees what each row gets at the batch size they decode with.

The tree is saved next to the heads as ``medusa_choices.json`` (a file the Medusa/TGI readers never look for), which
`MedusaModel.from_pretrained` loads and `MedusaModel.generate` uses unless given ``medusa_choices``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from liger_models.input_files import read_text
from liger_models.medusa.checkpoint import save_json
from liger_models.medusa.heads import MedusaHeads
from liger_models.medusa.tree import (MISS, TOPK, check_medusa_choices, default_medusa_choices, tree_for_batch,
                                     tree_from_rank_paths, walk_tokens_per_step)

CHOICES_NAME = "medusa_choices.json"
BATCHES = (1, 2, 4, 8, 16)  # batch sizes whose cut trees (`tree.tree_for_batch`) a calibration also scores
LOGITS_BUDGET_BYTES = 256 << 20  # heads' logits held at once while ranking (positions are chunked to fit)


@torch.no_grad()
def rank_paths(base: nn.Module, heads: MedusaHeads, sequence: torch.Tensor, start: int,
               topk: int = TOPK) -> torch.Tensor:
    """(N, K) int64: for each last committed position p from ``start`` − 1 on at which every head has a target, the
    rank of token p + 1 + d in head d's top-k at p (d = 1 … K), MISS where it is not there.

    sequence: (T,) token ids, greedy continuations of the base from ``start`` on (module docstring)."""
    num_heads = heads.num_heads
    first, end = max(start - 1, 0), sequence.shape[0] - 1 - num_heads
    if end <= first:  # a continuation shorter than the heads reach (it ended at EOS): nothing to rank
        return torch.zeros(0, num_heads, dtype=torch.long, device=sequence.device)
    positions = torch.arange(first, end, device=sequence.device)
    hidden = base.model(sequence[None])[0]  # (T, H)
    targets = sequence[positions[:, None] + 1 + torch.arange(1, num_heads + 1, device=sequence.device)]  # (N, K)
    chunk = max(1, LOGITS_BUDGET_BYTES // (num_heads * heads.config.vocab_size * 4))
    ranks = []
    for lo in range(0, len(positions), chunk):
        at = positions[lo: lo + chunk]
        # The same top-k call as decoding's candidates (tree.candidate_tokens), so ties rank alike.
        proposals = heads.logits(hidden[at], num_heads).topk(topk, dim=-1).indices  # (K, n, topk)
        hit = proposals == targets[lo: lo + chunk].T[..., None]
        ranks.append(torch.where(hit.any(-1), hit.int().argmax(-1), MISS).T)  # (n, K)
    return torch.cat(ranks)


@dataclass
class Calibration:
    """A fitted tree and what it is expected to gain: tokens per base-model forward as greedy decoding would walk
    the paths it was fitted on (`walk_tokens_per_step`)."""

    medusa_choices: list[tuple[int, ...]]
    positions: int  # rank paths it was fitted on
    tokens_per_step: float  # `walk_tokens_per_step` on those paths
    default_tokens_per_step: float  # the default tree of as many heads, the same way
    kept_default: bool = False  # the fitted tree walked no better than the default one, which was kept instead
    # batch size → (nodes, tokens per forward per row) of the tree as decoding cuts it for that batch
    by_batch: dict[int, tuple[int, float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"medusa_choices": [list(c) for c in self.medusa_choices], "positions": self.positions,
                "tokens_per_step": round(self.tokens_per_step, 4),
                "default_tokens_per_step": round(self.default_tokens_per_step, 4), "kept_default": self.kept_default,
                "by_batch": {str(batch): {"nodes": nodes, "tokens_per_step": round(tokens, 4)}
                             for batch, (nodes, tokens) in self.by_batch.items()}}


# What Medusa's verification decodes: no repetition penalty, n-gram blocking, minimum length or stop strings.
NEUTRAL_PROCESSORS = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0, min_length=0,
                          stop_strings=[])


@torch.no_grad()
def calibrate_medusa_choices(base: nn.Module, heads: MedusaHeads, prompts: Sequence[torch.Tensor], *,
                             new_tokens: int = 128, size: int = 63, topk: int = TOPK,
                             cuda_graph: bool = False) -> Calibration:
    """Greedy-decode each (T,) prompt for up to ``new_tokens`` (stopping at the checkpoint's EOS), rank the heads
    on the continuations and fit a tree of at most ``size`` choices. Both it and the default tree are then scored
    as decoding would run them (`walk_tokens_per_step`); when the default does at least as well, it is kept."""
    if not prompts:
        raise ValueError("calibrating a Medusa tree needs at least one prompt")
    per_sequence = []
    for prompt in prompts:
        # attention_mask: the prompt is text throughout, even where an id equals the pad id. The processors a
        # generation_config.json may set are turned off: the tree is fitted to what Medusa decoding verifies,
        # plain greedy continuations.
        sequence = base.generate(prompt[None], new_tokens, do_sample=False, cuda_graph=cuda_graph,
                                 attention_mask=torch.ones_like(prompt[None]), **NEUTRAL_PROCESSORS)[0]
        per_sequence.append(rank_paths(base, heads, sequence, len(prompt), topk).cpu())
    paths = torch.cat(per_sequence)
    if len(paths) == 0:
        raise ValueError(f"the continuations were too short to rank {heads.num_heads} heads on: give longer "
                         "--new-tokens or prompts whose continuation does not end at once")
    fitted, default = tree_from_rank_paths(paths, size), default_medusa_choices(heads.num_heads)
    fitted_score, default_score = (walk_tokens_per_step(tree, per_sequence) for tree in (fitted, default))
    if default_score >= fitted_score and len(default) <= size:
        calibration = Calibration(default, len(paths), default_score, default_score, kept_default=True)
    else:
        calibration = Calibration(fitted, len(paths), fitted_score, default_score)
    for batch in BATCHES:
        cut = tree_for_batch(calibration.medusa_choices, batch)
        calibration.by_batch[batch] = (len(cut) + 1, walk_tokens_per_step(cut, per_sequence))
    return calibration


def save_medusa_choices(directory: str | os.PathLike, calibration: Calibration) -> str:
    """Write ``medusa_choices.json`` into a heads directory (atomically); returns its path."""
    path = os.path.join(directory, CHOICES_NAME)
    save_json(path, calibration.to_json())
    return path


def load_medusa_choices(directory: str | os.PathLike, num_heads: int,
                        topk: int = TOPK) -> list[tuple[int, ...]] | None:
    """The tree saved in a heads directory (``{"medusa_choices": [...]}`` as saved, or a bare list of rank paths),
    None when there is none; a file that does not fit these heads (another head count, a rank past the top-k, a
    broken tree) or is not JSON is refused by name."""
    path = os.path.join(directory, CHOICES_NAME)
    if not os.path.isfile(path):
        return None
    try:
        raw = json.loads(read_text(path))  # not UTF-8: read_text names the file and the line
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); remove it or run calibrate-tree again") from None
    raw = raw.get("medusa_choices") if isinstance(raw, dict) else raw  # a bare list, as Medusa's own trees are
    if not isinstance(raw, list) or not all(isinstance(c, list) and all(isinstance(r, int) for r in c) for c in raw):
        raise ValueError(f"{path}: 'medusa_choices' must be a list of rank paths such as [[0], [0, 1]]")
    choices = [tuple(c) for c in raw]
    try:
        check_medusa_choices(choices, num_heads, topk)
    except ValueError as exc:
        raise ValueError(f"{path} does not fit these heads: {exc}") from None
    return choices
