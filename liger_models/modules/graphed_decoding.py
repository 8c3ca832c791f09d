"""Decoding calls replayed as CUDA graphs: a static KV cache and attention masks computed on the device.

Decoding a few tokens per call is host-bound: a Llama-3.2-1B call runs ~210 kernels whose GPU time is ~1.1 ms on an
H200, while issuing them from Python takes 10-20 ms. A CUDA graph replays all of a call's kernels from one launch.
It replays fixed shapes and fixed addresses, so here
  - the cache is preallocated at ``capacity`` slots (``StaticKVCache``); a call writes its T tokens at slots
    start … start + T − 1 through a device index, and attends over all ``capacity`` slots under a mask;
  - the mask (``device_mask``: AttentionMask's rule) is computed inside the graph from device tensors: ``start``
    (the first slot of the call), ``valid`` (B, capacity) (False at left padding) and the call's fixed (T, T)
    pattern among its own tokens (causal for one token; a Medusa tree's ancestor mask), so every replay sees its
    own step's keys;
  - a sliding window counts slots, as AttentionMask does (a tree token's slot is start + its depth).
``GraphedCall`` runs a call eagerly once (compiling the kernels and writing that step's keys), captures it, and
from then on copies the inputs into its static buffers and replays. The prefill stays eager (``KVCache``) and is
copied into the static cache with ``StaticKVCache.load``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .attention import FLEX_MIN_LEN, AttentionMask
from .cache import KVCache, check_kept

# False: every GraphedCall runs eagerly (same static cache and device masks, any device); the CPU tests set it.
CAPTURE = True


class StaticKVCache:
    """KVCache's ``update`` over preallocated (B, Hkv, capacity, D) buffers, written at the slots in ``slots``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.buffer: torch.Tensor | None = None  # (L, 2, B, Hkv, capacity, D): every layer's keys and values
        # (T,) long: where the running call's tokens go, the same in every row; or (B, T): each row's own slots
        # (rows decoded at their own lengths, medusa/batched_steps.py)
        self.slots: torch.Tensor | None = None

    def load(self, cache: KVCache) -> None:
        """Copy a dynamic cache's entries (slots 0 … its length − 1) in, allocating the buffers on first use."""
        length = cache.seq_length()
        if length > self.capacity:
            raise ValueError(f"{length} cached tokens do not fit a static cache of {self.capacity} slots")
        if not self.layers:
            self._allocate([(k, v) for k, v, _ in cache._layers.values()], list(cache._layers))
        for layer_idx, (keys, values, _) in cache._layers.items():
            for static, t in zip(self.layers[layer_idx], (keys, values)):
                static[:, :, :length] = t[:, :, :length]

    def _allocate(self, like: list[tuple[torch.Tensor, torch.Tensor]], indices: list[int]) -> None:
        # One (L, 2, B, Hkv, capacity, D) buffer, so `keep` moves every layer's accepted entries with one gather
        # instead of two per layer. Zeros: a masked slot still meets the softmax, and garbage there could be NaN
        # (NaN · 0 = NaN).
        shapes = {(*t.shape[:2], t.shape[3], t.dtype, t.device) for pair in like for t in pair}
        if len(shapes) != 1:
            raise ValueError(f"a static cache needs every layer's keys and values in one shape, got {shapes}")
        k = like[0][0]
        self.buffer = k.new_zeros(len(like), 2, k.shape[0], k.shape[1], self.capacity, k.shape[3])
        self.layers = {i: (self.buffer[j, 0], self.buffer[j, 1]) for j, i in enumerate(indices)}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layers[layer_idx]
        if self.slots.dim() == 1:
            keys.index_copy_(2, self.slots, k)
            values.index_copy_(2, self.slots, v)
        else:  # keys[b, :, slots[b, t]] = k[b, :, t]: the indexed view is (B, T, Hkv, D)
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            keys[rows, :, self.slots] = k.transpose(1, 2)
            values[rows, :, self.slots] = v.transpose(1, 2)
        return keys, values

    def keep(self, start: int, indices: torch.Tensor) -> None:
        """Of the slots from ``start`` on, keep those at ``start + indices`` packed from ``start`` (KVCache.keep)."""
        n = len(indices)
        check_kept(start, indices, self.capacity)
        if self.buffer is not None:  # advanced indexing gathers into a new tensor first: overlap is safe
            self.buffer[..., start: start + n, :] = self.buffer[..., indices + start, :]

    def keep_on_device(self, start: torch.Tensor, indices: torch.Tensor, packed: torch.Tensor) -> None:
        """``keep`` with ``start`` a device scalar, for a captured call: no host read, so no bounds check either
        (the caller's indices must lie in the slots it wrote). packed: ``arange(len(indices))`` on the device.
        Per row: start (B,) and indices (B, m), row b keeping its slots start[b] + indices[b]."""
        if start.dim() == 0:
            moved = self.buffer.index_select(-2, start + indices)  # a new tensor: overlapping slots are safe
            self.buffer.index_copy_(-2, start + packed, moved)
            return
        # buffer[:, :, b, :, slot] for the (B, m) pairs: advanced indices on dims 2 and 4, the view (B, m, L, 2, Hkv, D)
        rows = torch.arange(len(start), device=start.device)[:, None]
        moved = self.buffer[:, :, rows, :, start[:, None] + indices]
        self.buffer[:, :, rows, :, start[:, None] + packed] = moved


def device_mask(start: torch.Tensor, pattern: torch.Tensor, depth: torch.Tensor, capacity: int,
                valid: torch.Tensor | None) -> AttentionMask:
    """Which of the ``capacity`` slots each of a captured call's T tokens sees: AttentionMask's rule with the first
    slot ``start`` a device tensor, so every replay computes its own step's mask; ``start`` (B,) gives each row its
    own first slot (the mask is then (B, 1, T, capacity))."""
    past = start.view(-1, 1, 1) if start.dim() == 1 else start  # broadcasts against (T, 1) query, (1, S) key indices
    return AttentionMask(pattern.shape[0], past, None, start.device, valid, (pattern, depth), capacity=capacity)


class GraphedCall:
    """``model`` (a zoo causal LM) on T new tokens per row at slots start …, replayed as a CUDA graph.

    The T tokens are written to slots start … start + T − 1 in order. pattern (T, T) bool: which of the call's own
    tokens each sees (``torch.ones(1, 1)`` for one decoding step; a tree's ancestor mask); depth (T,): how far past
    the first slot each token sits in the sequence, which is what a sliding window counts (0 for one step; the node
    depth in a tree). valid: (B, capacity) bool, False at padded slots, or None. Returns (hidden (B, T, H),
    logits (B, T, V)) in static tensors that the next call overwrites.
    """

    def __init__(self, model: nn.Module, cache: StaticKVCache, batch: int, pattern: torch.Tensor,
                 depth: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        device = model.lm_head.weight.device
        graphed = CAPTURE
        if graphed and device.type != "cuda":
            raise ValueError(f"CUDA-graph decoding needs the model on a CUDA device, not {device}")
        T = pattern.shape[0]
        if T >= FLEX_MIN_LEN:
            raise ValueError(f"a graphed call takes fewer than {FLEX_MIN_LEN} tokens, got {T}")
        self.model, self.cache = model, cache
        self.ids = torch.zeros(batch, T, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, T, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.pattern, self.depth = pattern.to(device, torch.bool), depth.to(device, torch.long)
        self.offsets = torch.arange(T, device=device)  # slot of each token after the first
        self.valid, self.graphed = valid, graphed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def one_token(cls, model: nn.Module, cache: StaticKVCache, batch: int,
                  valid: torch.Tensor | None = None) -> "GraphedCall":
        """A call of one new token per row: one decoding step."""
        return cls(model, cache, batch, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long), valid)

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.slots = self.start + self.offsets
        mask = device_mask(self.start, self.pattern, self.depth, self.cache.capacity, self.valid)
        hidden = self.model.model.run(self.ids, self.positions, mask, self.cache)
        return hidden, self.model.compute_logits(hidden)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | int, start: int) -> tuple[torch.Tensor, ...]:
        """ids (B, T); positions (B, T) or one int for every token (a single decoding step); start: first slot."""
        if start + self.ids.shape[1] > self.cache.capacity:
            raise ValueError(f"slots {start} … {start + self.ids.shape[1] - 1} pass the static cache's "
                             f"{self.cache.capacity}")
        self.ids.copy_(ids)
        if isinstance(positions, int):
            self.positions.fill_(positions)
        else:
            self.positions.copy_(positions)
        self.start.fill_(start)
        if not self.graphed:
            return self._run()
        if self.graph is None:  # the warm-up writes this step's keys; the replay writes the same again
            self.graph, self.outputs = warm_up_and_capture(self._run, self.ids.device)
        with torch.cuda.device(self.ids.device):
            self.graph.replay()
        return self.outputs


def warm_up_and_capture(run: Callable[[], Any], device: torch.device,
                        generator: torch.Generator | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``run`` once eagerly, with all its effects (compiling the kernels, allocating what it allocates on first
    use), then capture it as a CUDA graph, which records the kernels without running them. Returns the graph, not
    yet replayed, and what the captured call returned: tensors in the graph's memory that every replay rewrites.
    generator: one that ``run`` draws from besides the device's default (which torch registers itself); each replay
    then advances it as the eager run does, so replays draw fresh numbers in the eager order.

    Everything happens on ``device``, which need not be the current one: a capture records only the work queued on
    its own stream, and torch would create that stream on the current device."""
    with torch.cuda.device(device):
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, stream=side):
            outputs = run()
        current.wait_stream(side)
    return graph, outputs
