"""Held-out evaluation during training: loss and, for Medusa, each head's top-1 / top-5 accuracy on eval data.

The same windows every time (the first ``max_batches`` rounds of the eval data, in order; a round is one micro-batch
per rank), so numbers compare across steps and runs; nothing random is drawn, so a resumed run stays exact.
No gradients: a weight stepped inside the forward (step_in_backward.py) must never see an eval forward as a step.
Every rank runs the same number of forwards, which FSDP needs. The normaliser is the count of targets over all eval
batches and ranks, so the summed per-batch losses are the mean over the whole eval set (as the trainer does for
gradient accumulation); a mixture-of-experts load-balancing loss is each round's, over every rank's batch.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_models.train import distributed as D
from liger_models.train.packing import PackedDataset


def eval_batches(dataset: PackedDataset, batch_size: int, info: D.DistInfo, max_batches: int) -> list[dict]:
    """This rank's eval micro-batches (CPU tensors): rank r takes rows [r·B, (r+1)·B) of each round of B × ranks
    windows; a last incomplete round is left out so that every rank has the same count."""
    per_round = batch_size * info.world_size
    rounds = min(max_batches, len(dataset) // per_round)
    if rounds == 0:
        raise ValueError(f"the eval data packs into {len(dataset)} windows of {dataset.seq_len} tokens; it needs at "
                         f"least --batch-size × processes = {per_round}")
    first = info.rank * batch_size
    return [dataset.batch(torch.arange(r * per_round + first, r * per_round + first + batch_size))
            for r in range(rounds)]


def global_counts(task, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, normaliser) of a global batch (the trainer's step and an evaluation): each loss term's non-ignored
    targets summed over ``batches`` and all ranks, and those counts clamped to ≥ 1 (a term without any target
    contributes 0, not 0/0)."""
    counts = torch.stack([task.counts(b) for b in batches]).sum(0)  # (terms,)
    D.all_reduce_sum(counts)
    return counts, counts.clamp(min=1)


@torch.no_grad()
def evaluate(model: nn.Module, task, batches: list[dict], info: D.DistInfo, step: int,
             max_steps: int) -> tuple[list[float], list[float]]:
    """(summed stats, target counts) over ``batches`` (on ``info.device`` already: the trainer moves its fixed eval
    set there once) and all ranks, in the task's stats layout (trainer.py)."""
    counts, normalizer = global_counts(task, batches)
    was_training = model.training
    model.eval()
    try:
        stats = None
        with D.balanced_over_ranks():
            for batch in batches:
                s = task.forward(model, batch, normalizer, step, max_steps)[1]
                stats = s if stats is None else stats + s
    finally:
        model.train(was_training)
    D.all_reduce_sum(stats)
    return stats.tolist(), counts.tolist()
