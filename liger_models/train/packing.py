"""Packing tokenized documents into fixed-length windows with per-document positions.

Documents (BOS/EOS added the way the model's tokenizer does) are concatenated into one stream and cut into windows
of ``seq_len`` tokens; a document may continue into the next window. ``position_ids`` restart at 0 at every document
start and at every window start, which is how the models and the Medusa heads see boundaries (attention and every
shifted label stop there). Labels are HF-aligned (= input ids, -100 where no loss); the last window is padded with
ignored tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from liger_models.modules.loss import shift_labels

IGNORE_INDEX = -100


class PackedDataset:
    """Fixed-length windows: ``input_ids``, ``labels`` (HF-aligned, -100 = no loss) and ``position_ids``, (N, T)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor):
        assert input_ids.shape == labels.shape == position_ids.shape and input_ids.dim() == 2
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[indices].long(),
            "labels": self.labels[indices].long(),
            "position_ids": self.position_ids[indices].long(),
        }


def batch_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch's tensors on ``device`` (non-blocking; tensors already there are returned as they are)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def pack_documents(tokenized: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_len: int,
                   pad_id: int = 0) -> PackedDataset:
    """Concatenate tokenized documents (ids and mask per document, lists or arrays) and cut them into
    ``seq_len`` windows (module docstring)."""
    ids = [np.asarray(i, dtype=np.int32) for i, _ in tokenized]
    masks = [np.asarray(m, dtype=bool) for _, m in tokenized]
    for n, (i, m) in enumerate(zip(ids, masks)):
        if i.shape != m.shape or i.ndim != 1:
            # Unequal lengths that cancel out over the stream would shift every later label onto another token.
            raise ValueError(f"document {n}: {i.shape} token ids but a loss mask of {m.shape}; they must be 1-D and "
                             "of one length")
    lengths = np.array([i.size for i in ids], dtype=np.int64)
    return pack_arrays(ids, masks, lengths, seq_len, pad_id)


def _joined(parts: list[np.ndarray], pad: int, fill) -> np.ndarray:
    # One array of the parts plus ``pad`` fill values; the parts list is emptied so its memory goes at once.
    flat = np.concatenate([*parts, np.full(pad, fill, dtype=parts[0].dtype)])
    parts.clear()
    return flat


def pack_arrays(id_parts: list[np.ndarray], mask_parts: list[np.ndarray], lengths: np.ndarray, seq_len: int,
                pad_id: int = 0) -> PackedDataset:
    """:func:`pack_documents` on concatenated chunks: ``id_parts`` / ``mask_parts`` (int32 / bool) hold the
    documents back to back, ``lengths`` their token counts. The two lists are emptied (their memory freed)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    lengths = lengths[lengths > 0]  # a document without tokens has no start
    total = int(lengths.sum())
    sizes = sum(a.size for a in id_parts), sum(a.size for a in mask_parts)
    if sizes != (total, total):
        raise ValueError(f"{sizes[0]} token ids and {sizes[1]} loss-mask entries for documents of {total} tokens "
                         "in all; the three must agree")
    if total == 0:
        raise ValueError("the data produced no tokens")
    n_windows = -(-total // seq_len)
    size = n_windows * seq_len
    ids = _joined(id_parts, size - total, pad_id)
    has_loss = _joined(mask_parts, size - total, False)
    starts = np.zeros(size, dtype=bool)
    starts[np.cumsum(lengths)[:-1]] = True
    starts[::seq_len] = True
    if size > total:
        starts[total] = True  # the padding counts as one more document
    # position = distance to the latest document (or window) start, over the flat stream (rows are windows).
    positions = np.arange(size, dtype=np.int32 if size < 2**31 else np.int64)
    last_start = np.where(starts, positions, 0)
    del starts
    np.maximum.accumulate(last_start, out=last_start)
    positions -= last_start
    del last_start
    labels = np.where(has_loss, ids, np.int32(IGNORE_INDEX))
    shape = (n_windows, seq_len)
    return PackedDataset(torch.from_numpy(ids).view(shape), torch.from_numpy(labels).view(shape),
                         torch.from_numpy(positions.astype(np.int32, copy=False)).view(shape))


def check_has_targets(dataset: PackedDataset) -> None:
    """Raise unless some token is a target of the causal loss: labelled, with the token before it in the same
    document and window (a window's or a document's first token is never predicted)."""
    targets = shift_labels(dataset.labels, 1, dataset.position_ids, IGNORE_INDEX)
    if not bool((targets != IGNORE_INDEX).any()):
        raise ValueError("the data has no token to train on (every label is masked, or sits where nothing "
                         "predicts it: at a document's or window's start)")
