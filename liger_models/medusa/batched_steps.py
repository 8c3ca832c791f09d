"""Medusa tree decoding of several sequences at once (or of one left-padded sequence), each at its own length.

A batch-1 step (graphed_step.py) accepts some number of candidates and moves on; in a batch every row accepts its
own number, so the rows' lengths part after the first step. Here each row keeps its own count of committed slots
in a static KV cache (``StaticKVCache`` with per-row slots), so no row carries holes and a sliding window that
counts slots counts that row's positions:

  state (on the device, static):  hidden (B, H), root (B,) as in graphed_step.py; length (B,) each row's committed
                                  slots (left padding included), position (B,) its next position (HF's
                                  cumsum(mask) − 1 rule: padding does not count), emitted (B,) new tokens so far,
                                  done (B,) an EOS accepted or the budget reached
  one step:                       every row's tree at slots length[b] …, one tree-masked base call over the batch
                                  (each row its own first slot and padding), acceptance per row, each row's accepted
                                  path packed down to its own slots; a done row is frozen (its length and state stay,
                                  so its slots stay within the cache however many steps the others still take)
  result (B, D+2):                per row n, then the winning path's D+1 tokens; rows the host knows to be done
                                  are ignored

Greedy, row b's tokens are plain greedy decoding's of that row alone, and the whole output is plain batched
``generate``'s: (B, T + n) with rows that stopped at an EOS filled with the pad id. Each step runs eagerly or
(cuda_graph=True) as one CUDA graph replay with the next launched before this one's result is read; the rotary
table must not depend on the length within the call (``check_one_rotary_table``), since rows at different lengths
share each call's table.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_models.medusa.acceptance import accept, draw
from liger_models.medusa.graphed_step import GraphedSteps
from liger_models.medusa.heads import MedusaHeads, base_logits
from liger_models.medusa.tree import MedusaBuffers, candidate_tokens
from liger_models.modules import graphed_decoding
from liger_models.modules.cache import KVCache
from liger_models.modules.generate import padded_positions
from liger_models.modules.graphed_decoding import StaticKVCache, device_mask


def rows_capacity(prompt_length: int, budget: int, buffers: MedusaBuffers) -> int:
    """Static cache slots for rows decoding ``budget`` new tokens: a live row has fewer than ``budget`` tokens
    after the prompt, its last step can overshoot by ``depth`` accepted tokens, and a frozen row still writes a tree
    past its length at every step."""
    return prompt_length + budget + buffers.depth + len(buffers.tree_indices)


def check_one_rotary_table(base: nn.Module, prompt_length: int, budget: int, depth: int,
                           mask: torch.Tensor | None = None) -> None:
    """Refuse a rotary embedding whose table changes within the positions these rows reach (longrope past
    original_max_position_embeddings, dynamic NTK past max_position_embeddings): its table is chosen per call by the
    furthest position in it, so rows at different lengths would rotate with other tables than they would alone.

    Positions, not slots: with left padding (``mask``, (B, T)) a row's positions (HF's cumsum(mask) − 1) lag its
    slots, and the table follows the positions. From ``start``, the furthest row's next position (the prompt length
    without padding), plain generate's steps are calls of length start + 1 …; a live row's last Medusa step starts
    below start + budget and commits up to depth + 1 tokens, and frozen there its trees reach depth further. Plain
    generate also recomputes the whole sequence when longrope's regime changes with the slot count
    (modules/generate.py), which these steps never do, so that must not happen within the budget either."""
    rotary = getattr(base.model, "rotary", None)
    if rotary is None:
        return
    start = prompt_length
    if mask is not None:
        start = int(padded_positions(mask)[:, -1].max()) + 1  # as the prefill takes them
    first, furthest = start + 1, start + budget + 2 * depth + 1  # sequence lengths: the furthest position + 1
    if ((rotary.regime(first), rotary.table_key(first)) != (rotary.regime(furthest), rotary.table_key(furthest))
            or rotary.regime(prompt_length) != rotary.regime(prompt_length + budget)):
        raise ValueError(f"this model's {rotary.rope_type} rotary table changes within the lengths these rows reach "
                         f"({min(first, prompt_length)} … {max(furthest, prompt_length + budget)}), so sequences of "
                         "different lengths cannot share Medusa steps: decode the prompts one at a time, unpadded, or "
                         "with fewer new tokens")


class BatchedSteps(GraphedSteps):
    """Medusa steps over ``batch`` rows (see the module docstring); ``graphed``: each step one CUDA graph replay.
    ``budget`` new tokens per row; ``eos``: the stop ids. ``_launch`` / ``_read`` are GraphedSteps'."""

    def __init__(self, base: nn.Module, heads: MedusaHeads, buffers: MedusaBuffers, topk: int, capacity: int,
                 acceptance: tuple[float, float, float], generator: torch.Generator | None, *, batch: int,
                 budget: int, eos: list[int], graphed: bool) -> None:
        device = base.lm_head.weight.device
        graphed = graphed and graphed_decoding.CAPTURE
        if graphed and device.type != "cuda":
            raise ValueError(f"CUDA-graph decoding needs the model on a CUDA device, not {device}")
        self.base, self.heads, self.buffers, self.topk, self.budget = base, heads, buffers, topk, budget
        self.acceptance, self.generator = acceptance, generator if acceptance[0] > 0 else None
        self.graphed = graphed
        self.cache = StaticKVCache(capacity)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)
        self.slot_offsets = torch.arange(len(buffers.tree_indices), device=device)
        self.packed = torch.arange(buffers.depth + 1, device=device)
        self.rows = torch.arange(batch, device=device)
        self.hidden: torch.Tensor | None = None  # (B, H), allocated by the prefill
        self.root = torch.zeros(batch, dtype=torch.long, device=device)
        self.length, self.position, self.emitted = (torch.zeros(batch, dtype=torch.long, device=device)
                                                    for _ in range(3))
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.valid: torch.Tensor | None = None  # (B, capacity), False at the prompt's padding; None without any
        self.result = torch.zeros(batch, buffers.depth + 2, dtype=torch.long, device=device)
        self._init_launches()

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        """The base on the left-padded prompts ids (B, T) with their attention mask (eagerly, as plain generate
        runs it), copied into the static cache; the state after them."""
        positions = None if mask is None else padded_positions(mask)
        cache = KVCache()
        hidden = self.base.model(ids, positions, cache=cache, attention_mask=mask)[:, -1]
        self.cache.load(cache)
        T = ids.shape[1]
        if mask is not None:
            self.valid = torch.ones(len(ids), self.cache.capacity, dtype=torch.bool, device=ids.device)
            self.valid[:, :T] = mask.bool()
        self.length.fill_(T)
        # The next position follows the last one, as plain generate continues it (with left padding, the count of
        # real tokens; after a padded last token, HF's rule restarts at 1).
        self.position.copy_(positions[:, -1] + 1 if mask is not None else self.length)
        self.hidden = hidden.clone()
        self.root.copy_(draw(base_logits(self.base, hidden), self.acceptance[0], self.generator))

    def tree(self, ahead: bool = False) -> list[list[int]]:
        """One step of every row: per row [n, the winning path's D+1 tokens] (its first n + 1 are emitted).
        ahead: launch the next step before reading this one (the caller will take another step, or stop)."""
        current = self.queued if self.queued is not None else self._launch()
        self.queued = self._launch() if ahead else None  # here the handle alone: rows have no one start slot
        return self._read(current)

    def _step(self) -> None:
        buffers, rows = self.buffers, self.rows
        tree = candidate_tokens(self.heads, self.hidden, self.root, buffers, self.topk)  # (B, 1+N)
        self.cache.slots = self.length[:, None] + self.slot_offsets
        mask = device_mask(self.length, buffers.tree_mask, buffers.tree_position_ids, self.cache.capacity, self.valid)
        positions = self.position[:, None] + buffers.tree_position_ids
        out = self.base.model.run(tree, positions, mask, self.cache)  # (B, 1+N, H)
        logits = base_logits(self.base, out)  # (B, 1+N, V)
        row, n = accept(tree, logits, buffers.path_nodes, buffers.path_valid, *self.acceptance)  # (B,), (B,)
        nodes = buffers.path_nodes[row]  # (B, D+1): each row's winning path, root first
        self.cache.keep_on_device(self.length, nodes, self.packed)  # slots past length + n are never attended
        last = nodes[rows, n]  # (B,) each row's last accepted node
        tokens = tree.gather(1, nodes)  # (B, D+1)
        self.result.copy_(torch.cat([n[:, None], tokens], dim=1))
        live = ~self.done
        self.hidden.copy_(torch.where(live[:, None], out[rows, last], self.hidden))
        self.root.copy_(torch.where(live, draw(logits[rows, last], self.acceptance[0], self.generator), self.root))
        advance = torch.where(live, n + 1, 0)
        accepted = self.packed <= n[:, None]  # (B, D+1)
        stopped = ((tokens[..., None] == self.eos).any(-1) & accepted).any(-1)
        self.length += advance
        self.position += advance
        self.emitted += advance
        self.done |= stopped | (self.emitted >= self.budget)


def decode_rows(steps: BatchedSteps, input_ids: torch.Tensor, mask: torch.Tensor | None, budget: int,
                eos: set[int], fill: int, launch_ahead: bool) -> tuple[torch.Tensor, list[list[int]]]:
    """Run ``steps`` until every row has its budget or an EOS: the (B, T + n) output, rows that stopped early
    filled with ``fill`` as plain generate fills them, and each row's tokens per step."""
    steps.prefill(input_ids, mask)
    batch, depth = input_ids.shape[0], steps.buffers.depth
    new: list[list[int]] = [[] for _ in range(batch)]
    per_step: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    while not all(finished):
        # Another step will surely follow when a live row cannot reach its budget in this one (an EOS may still
        # end every row: the step launched ahead is then wasted, never wrong, as done rows are frozen).
        ahead = launch_ahead and any(not finished[b] and len(new[b]) + depth + 1 < budget for b in range(batch))
        for b, (n, *path) in enumerate(steps.tree(ahead)):
            if finished[b]:
                continue
            step_tokens = path[: n + 1][: budget - len(new[b])]
            stop = next((i for i, t in enumerate(step_tokens) if t in eos), None)
            if stop is not None:
                step_tokens = step_tokens[: stop + 1]
            new[b] += step_tokens
            per_step[b].append(len(step_tokens))
            finished[b] = stop is not None or len(new[b]) >= budget
    width = max(len(tokens) for tokens in new)
    grown = torch.tensor([tokens + [fill] * (width - len(tokens)) for tokens in new], dtype=torch.long,
                         device=input_ids.device).view(batch, width)
    return torch.cat([input_ids, grown], dim=1), per_step
