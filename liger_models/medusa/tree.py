"""A Medusa candidate tree laid out for verification, and the candidate tokens a step puts in it.

`medusa_choices` is a tree of rank paths: (0, 1) = head 1's rank 0, then head 2's rank 1. Node 0 is the root (the
base model's own next token); every other node is one choice. Decoding (decoding.py, graphed_step.py) fills the
nodes from the heads' top-k and verifies them in one tree-masked call.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from liger_models.medusa.heads import MedusaHeads

TOPK = 10
MISS = -1  # in a rank path: the token was not in the head's top-k
# The most tokens one verification call carries over a batch (B rows × (1 + N) nodes) before it costs clearly more
# than a plain step, which reads every weight once for its B tokens: measured on an H200 at 1B and 8B widths
# (2026-12-01/02, benchmarks/bench_medusa_batched.py; BENCHMARKS.md, "Decoding"). `tree_for_batch` cuts a tree to
# fit it.
TREE_TOKENS = 96


@dataclass
class MedusaBuffers:
    """The tree laid out for verification (`generate_medusa_buffers`).

    tree_mask: (1+N, 1+N) bool, node i may attend to node j (root and ancestors, itself included).
    tree_indices: (1+N,) index of each node's token in the flat candidate vector [root, head1 top-k, head2 top-k, …].
    tree_position_ids: (1+N,) depth of each node (root 0).
    retrieve_indices: (P, depth+1) tree-node indices of each root-to-leaf path, padded with -1.
    Derived: path_nodes, retrieve_indices with the padding pointing at the root (so it can index), and path_valid
    (P, depth+1), False at the padding (never accepted); depth, the deepest path's node count past the root.
    """

    tree_mask: torch.Tensor
    tree_indices: torch.Tensor
    tree_position_ids: torch.Tensor
    retrieve_indices: torch.Tensor
    path_nodes: torch.Tensor = field(init=False)
    path_valid: torch.Tensor = field(init=False)
    depth: int = field(init=False)

    def __post_init__(self) -> None:
        self.path_nodes = self.retrieve_indices.clamp(min=0)
        self.path_valid = self.retrieve_indices >= 0
        self.depth = self.retrieve_indices.shape[1] - 1


def dense_medusa_choices(widths: Sequence[int]) -> list[tuple[int, ...]]:
    """The Cartesian tree of `widths` (e.g. [4, 2, 1]: head 1's top-4, each followed by head 2's top-2, …)."""
    out: list[tuple[int, ...]] = []
    for depth in range(1, len(widths) + 1):
        out.extend(itertools.product(*(range(w) for w in widths[:depth])))
    return out


# How much less promising a candidate is, in tenths of a rough log-odds unit, for each head deeper (heads 2, 3, 4)
# and for each rank down: fitted to the order of Medusa's published 63-node tree, which its authors built from
# measured head accuracies (a second head at rank 0 beats the first head's rank 1; a third head's rank 0 comes after
# the first head's rank 2).
DEPTH_COST, RANK_COST = (0, 9, 15, 15), 10


def choice_cost(choice: Sequence[int]) -> int:
    """The default ordering's cost of a choice (DEPTH_COST per head it reaches, RANK_COST per rank down): lower is
    more promising. Both grow along a path, so a parent always costs less than its children."""
    depth = sum(DEPTH_COST[min(level, len(DEPTH_COST) - 1)] for level in range(len(choice)))  # heads past 4: as 4
    return depth + RANK_COST * sum(choice)


def default_medusa_choices(num_heads: int) -> list[tuple[int, ...]]:
    """A 44-node (for ≥ 4 heads) tree: top-4 from head 1, top-2 from heads 2 and 3, top-1 from head 4.

    Listed most promising first (`choice_cost`), as `tree_for_batch` wants; a choice's parent always comes before
    it, so every prefix is a tree."""
    return sorted(dense_medusa_choices([4, 2, 2, 1][:num_heads]), key=lambda c: (choice_cost(c), len(c), c))


def prefix_counts(rank_paths: torch.Tensor) -> Counter:
    """How many rows of ``rank_paths`` (N, D) start with each choice. Row p holds, for a step whose last committed
    position is p, the rank of the token each head had to propose within its top-k (MISS where it was not there), so
    a choice (r1, …, rd) would have been accepted at p iff the row starts with it (greedy acceptance)."""
    counts: Counter = Counter()
    for row in rank_paths.tolist():
        path: tuple[int, ...] = ()
        for rank in row:
            if rank == MISS:
                break
            path += (rank,)
            counts[path] += 1
    return counts


def tree_from_rank_paths(rank_paths: torch.Tensor, size: int) -> list[tuple[int, ...]]:
    """The tree of at most ``size`` choices that accepts the most tokens on ``rank_paths`` (`prefix_counts`).

    A step accepts one token for every choice in the tree that its row starts with, so a tree's mean accepted length
    is the sum of its choices' counts / N, and the best tree holds the ``size`` most-counted choices: a choice never
    counts more than its parent, and ties go to the shorter one, so those choices always form a tree. This measures
    acceptance jointly over the heads, where the Medusa paper's construction multiplies per-head accuracies as if
    they were independent. Choices no row reached are left out (an empty count gives the one-node tree (0,)).
    Listed most-counted first, so that every prefix is the best tree of its own size (`tree_for_batch`)."""
    if size < 1:
        raise ValueError(f"a Medusa tree needs at least one choice, got size {size}")
    counts = prefix_counts(rank_paths)
    return sorted(counts, key=lambda c: (-counts[c], len(c), c))[:size] or [(0,)]


def tree_for_batch(medusa_choices: Sequence[Sequence[int]], batch: int,
                   tree_tokens: int | None = TREE_TOKENS) -> list[tuple[int, ...]]:
    """The part of a tree that ``batch`` rows verify in one call: its first max(1, tree_tokens // batch − 1) choices
    in the order listed, skipping any whose parent was not taken; the whole tree while it fits (tree_tokens None or
    0: always).

    A plain step of B rows reads every weight once for B tokens; a Medusa step computes B · (1 + N) tree tokens, so
    once those are many the call costs several plain steps (8B, the 45-node default tree: 1.1× a plain step at one
    row, 3.9× at 16) and a tree no head fills that well loses to plain decoding. Cut to ``tree_tokens`` per call, a
    step stays near a plain one at any batch. Which choices stay is the list's order: most promising first for the
    default tree and for calibrated ones (`default_medusa_choices`, `tree_from_rank_paths`)."""
    choices = [tuple(c) for c in medusa_choices]
    if batch < 1:
        raise ValueError(f"a batch has at least one row, got {batch}")
    if tree_tokens is not None and tree_tokens < 0:
        raise ValueError(f"tree_tokens must be >= 0 (0: never cut), got {tree_tokens}")
    size = len(choices) if not tree_tokens else max(1, tree_tokens // batch - 1)
    if size >= len(choices):
        return choices
    kept: list[tuple[int, ...]] = []
    for choice in choices:
        if len(kept) == size:
            break
        if choice not in kept and (len(choice) == 1 or choice[:-1] in kept):
            kept.append(choice)
    return kept


def mean_accepted(medusa_choices: Sequence[Sequence[int]], rank_paths: torch.Tensor) -> float:
    """The mean number of candidates (root excluded) a greedy step with this tree accepts on ``rank_paths``."""
    counts = prefix_counts(rank_paths)
    return sum(counts[tuple(c)] for c in {tuple(c) for c in medusa_choices}) / max(len(rank_paths), 1)


def walk_tokens_per_step(medusa_choices: Sequence[Sequence[int]], paths_per_sequence: Sequence[torch.Tensor]) -> float:
    """Tokens per base-model forward that greedy decoding with this tree emits on these rank paths: each sequence's
    first step starts at its first row and every next one where the previous ended (1 + accepted rows on), as
    decoding does. `mean_accepted` averages over every row instead, which overweights stretches where steps accept
    much (decoding skips over them quickly), so it overstates the gain and can rank two trees the wrong way round."""
    steps = [n for paths in paths_per_sequence for n in walk_steps(medusa_choices, paths)]
    return sum(steps) / max(len(steps), 1)


def walk_steps(medusa_choices: Sequence[Sequence[int]], rank_paths: torch.Tensor) -> list[int]:
    """The tokens each greedy step emits (1 + accepted) along one sequence's rank paths, the first step at row 0."""
    tree = {tuple(c) for c in medusa_choices}
    rows, p, steps = rank_paths.tolist(), 0, []
    while p < len(rows):
        accepted = 0
        while accepted < len(rows[p]) and rows[p][accepted] != MISS and tuple(rows[p][: accepted + 1]) in tree:
            accepted += 1
        steps.append(1 + accepted)
        p += 1 + accepted
    return steps


def check_medusa_choices(medusa_choices: Sequence[Sequence[int]], num_heads: int,
                         topk: int = TOPK) -> list[tuple[int, ...]]:
    """The tree's choices as tuples, each once, in the order listed; refused by name when they are not a tree these
    heads can fill (a rank past the top-k, deeper than the heads, a missing parent, a dense width spec)."""
    # Medusa v0.1's dense widths (e.g. [1, 7, 6]) would otherwise fail with "'int' object is not iterable".
    if any(isinstance(c, int) for c in medusa_choices):
        raise ValueError(f"medusa_choices must be rank paths such as [(0,), (0, 1)], got {list(medusa_choices)[:4]}; "
                         "for a dense spec of per-head widths use dense_medusa_choices(widths)")
    choices = list(dict.fromkeys(tuple(c) for c in medusa_choices))
    if not choices or any(len(c) == 0 for c in choices):
        raise ValueError("medusa_choices must be a non-empty list of non-empty rank paths")
    depth = max(len(c) for c in choices)
    if depth > num_heads:
        raise ValueError(f"medusa_choices reach depth {depth} but the model has only {num_heads} Medusa heads")
    if any(r < 0 or r >= topk for c in choices for r in c):
        raise ValueError(f"every rank in medusa_choices must be in [0, {topk})")
    listed = set(choices)
    missing = [c for c in sorted(choices, key=lambda c: (len(c), c)) if len(c) > 1 and c[:-1] not in listed]
    if missing:
        raise ValueError(f"medusa_choices must contain every path's parent; missing parents of {missing[:3]}")
    return choices


def generate_medusa_buffers(medusa_choices: Sequence[Sequence[int]], num_heads: int, topk: int = TOPK,
                            device: torch.device | str | None = None) -> MedusaBuffers:
    """Tree mask, node → candidate indices, node depths and root-to-leaf paths for `medusa_choices`."""
    choices = sorted(check_medusa_choices(medusa_choices, num_heads, topk), key=lambda c: (len(c), c))
    depth = max(len(c) for c in choices)
    node = {c: i + 1 for i, c in enumerate(choices)}  # node 0 is the root
    n = len(choices) + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    indices = torch.zeros(n, dtype=torch.long)
    positions = torch.zeros(n, dtype=torch.long)
    for c, i in node.items():
        for d in range(1, len(c)):
            mask[i, node[c[:d]]] = True
        indices[i] = 1 + topk * (len(c) - 1) + c[-1]
        positions[i] = len(c)
    leaves = [c for c in choices if not any(o[:len(c)] == c and len(o) > len(c) for o in choices)]
    retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for p, c in enumerate(leaves):
        retrieve[p, : len(c) + 1] = torch.tensor([0] + [node[c[:d]] for d in range(1, len(c) + 1)])
    return MedusaBuffers(*(t.to(device) for t in (mask, indices, positions, retrieve)))


def candidate_tokens(heads: MedusaHeads, hidden: torch.Tensor, root: torch.Tensor, buffers: MedusaBuffers,
                     topk: int) -> torch.Tensor:
    """(B, 1+N) node tokens of B sequences: each one's root (B,), then each node's rank from the top-k of the head
    at its depth, which reads the base's last hidden state (B, H)."""
    proposals = heads.logits(hidden, buffers.depth).topk(topk, dim=-1).indices  # (D, B, topk)
    return torch.cat([root[:, None], proposals.transpose(0, 1).flatten(1)], dim=1)[:, buffers.tree_indices]
