"""A deterministic, resumable stream of micro-batches over packed windows.

:class:`BatchStream` walks an endless sequence of epochs, each a seeded permutation of the windows. Its whole state
is ``(seed, consumed)``: a resumed run draws exactly the batches the interrupted one would have drawn. With several
ranks, global micro-batch j is windows ``[j·B·W, (j+1)·B·W)`` of that sequence and rank r takes the r-th slice of B,
so W ranks × B equals one rank × (B·W) sample for sample.
"""

from __future__ import annotations

import warnings

import torch

from liger_models.modules.loss import shift_labels
from liger_models.train.packing import IGNORE_INDEX, PackedDataset


def repeats_note(dataset: PackedDataset, sequences: int) -> str:
    """What a user is told when the data holds fewer windows than the ``sequences`` of one micro-batch (all ranks):
    every micro-batch then repeats windows, and one window (data shorter than --seq-len) is trained on alone. The run
    goes on: memorising a small text is a legitimate test of a setup, and a mistaken --seq-len is obvious from the
    numbers."""
    targets = int((shift_labels(dataset.labels, 1, dataset.position_ids, IGNORE_INDEX) != IGNORE_INDEX).sum())
    n, them = len(dataset), "it" if len(dataset) == 1 else "them"
    held = (f"fits in one sequence of --seq-len {dataset.seq_len}" if n == 1
            else f"fills {n} sequences of --seq-len {dataset.seq_len}")
    return (f"the training data {held} ({targets} tokens to predict), fewer than the {sequences} of one micro-batch: "
            f"every micro-batch repeats {them}, so the loss falls by memorising {them}; more data, a smaller --seq-len "
            "or a smaller --batch-size gives distinct sequences")


class BatchStream:
    """Deterministic, resumable micro-batches over endless seeded epochs (module docstring)."""

    def __init__(self, dataset: PackedDataset, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.consumed = 0  # windows drawn so far by all ranks together
        self._epoch, self._perm = -1, None
        if rank == 0 and len(dataset) < batch_size * world_size:
            warnings.warn(repeats_note(dataset, batch_size * world_size), stacklevel=2)

    def _window(self, global_index: int) -> int:
        epoch, offset = divmod(global_index, len(self.dataset))
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.dataset), generator=gen)
        return int(self._perm[offset])

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's next (B, T) micro-batch; advances the global position by B × world_size."""
        first = self.consumed + self.rank * self.batch_size
        indices = torch.tensor([self._window(first + i) for i in range(self.batch_size)])
        self.consumed += self.batch_size * self.world_size
        return self.dataset.batch(indices)

    @property
    def epoch(self) -> float:
        return self.consumed / len(self.dataset)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "consumed": self.consumed, "num_windows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_windows"] != len(self.dataset):
            raise ValueError(
                f"resume: the checkpoint's data had {state['num_windows']} windows, this data has "
                f"{len(self.dataset)} (different data, tokenizer or --seq-len?)"
            )
        self.seed, self.consumed = state["seed"], state["consumed"]
        self._epoch, self._perm = -1, None  # the cached permutation may be another seed's
