"""Medusa steps replayed whole as one CUDA graph each: heads, candidates, verification, acceptance, compaction.

Run eagerly, a batch-1 step is bounded by the host: besides the base's calls, the heads' ResBlocks and projection,
top-k, the tree's gather, the acceptance and the cache compaction are ~40 launches and a few host reads. Every
input a step needs is on the device, so here the whole step is one graph, for greedy and for typical acceptance:

  state (on the device, static):  hidden (1, H) the last committed token's final hidden state; root (1,) the base's
                                  next token after it (argmax, or drawn from the generator); length () the committed
                                  token count, set by the host each step
  one replay:                     proposals = heads' top-k on hidden → node tokens → the tree-masked base call at
                                  slots length … → the winning path and its accepted prefix (acceptance.accept) →
                                  its keys and values packed down to slots length … → result = (n, path tokens) and
                                  the new hidden / root (those after the last accepted node)

The host reads ``result`` (one device-to-host copy per step) to extend the output, stop at EOS and check the rotary
table. The step's ops are those of the eager path (``decoding._Steps``) and the draws come from the same generator in
the same order (a graph replay advances a registered generator as the eager kernels would), so the tokens match it:
greedy, they are plain greedy decoding's.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_models.medusa.acceptance import accept, draw
from liger_models.medusa.heads import MedusaHeads
from liger_models.medusa.tree import MedusaBuffers, candidate_tokens
from liger_models.modules.cache import KVCache
from liger_models.modules.graphed_decoding import GraphedCall, StaticKVCache, device_mask, warm_up_and_capture


class GraphedSteps:
    """Medusa decoding steps of ``base`` with ``heads`` over a static cache of ``capacity`` slots, each tree step one
    CUDA graph replay (``graphed_decoding.CAPTURE`` off: the same work eagerly, for the CPU tests).

    buffers: the tree (``tree.MedusaBuffers``); acceptance: (temperature, posterior_threshold, posterior_alpha) as
    ``acceptance.accept`` takes them; generator: the draws' (None: the device's default). Methods as
    ``decoding._Steps``: ``prefill(ids)``, ``root_only(length)`` and ``tree(length)``, the last two returning the
    step's tokens."""

    def __init__(self, base: nn.Module, heads: MedusaHeads, buffers: MedusaBuffers, topk: int, capacity: int,
                 acceptance: tuple[float, float, float], generator: torch.Generator | None) -> None:
        device = base.lm_head.weight.device
        self.base, self.heads, self.buffers, self.topk = base, heads, buffers, topk
        self.acceptance, self.generator = acceptance, generator
        self.cache = StaticKVCache(capacity)
        self.one_token = GraphedCall.one_token(base, self.cache, 1)  # a step whose tree would span two rotary tables
        self.graphed = self.one_token.graphed
        self.slot_offsets = torch.arange(len(buffers.tree_indices), device=device)
        self.packed = torch.arange(buffers.depth + 1, device=device)
        self.hidden: torch.Tensor | None = None  # (1, H), allocated by the first prefill
        self.root = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.result = torch.zeros(buffers.depth + 2, dtype=torch.long, device=device)  # n, then the path's D+1 tokens
        self.graph: torch.cuda.CUDAGraph | None = None

    def prefill(self, ids: torch.Tensor) -> None:
        """The base on ids (1, T) from an empty cache (eagerly), copied into the static cache; the state after it."""
        cache = KVCache()
        hidden = self.base.model(ids, cache=cache)[:, -1]
        self.cache.load(cache)
        self._set_state(hidden, self.base.lm_head(hidden))

    def _set_state(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        if self.hidden is None:
            self.hidden = torch.empty_like(hidden)  # the graph reads this tensor: it is refilled, never replaced
        self.hidden.copy_(hidden)
        self.root.copy_(draw(logits, self.acceptance[0], self.generator))

    def root_only(self, length: int) -> list[int]:
        """Emit the root alone at slot ``length`` (one-token graphed call) and move the state past it."""
        root = self.root.clone()
        hidden, logits = self.one_token(root[None], length, length)
        self._set_state(hidden[:, 0], logits[:, 0])
        return root.tolist()

    def tree(self, length: int) -> list[int]:
        """One Medusa step after ``length`` committed tokens: the root and the accepted candidates."""
        if length + len(self.slot_offsets) > self.cache.capacity:  # inside the graph it would be a device assert
            raise ValueError(f"a tree at slots {length} … {length + len(self.slot_offsets) - 1} passes the static "
                             f"cache's {self.cache.capacity}")
        self.length.fill_(length)
        if not self.graphed:
            self._step()
        elif self.graph is None:  # the warm-up is this step; the capture only records it
            self.graph, _ = warm_up_and_capture(self._step, self.root.device, self.generator)
        else:
            with torch.cuda.device(self.root.device):
                self.graph.replay()
        n, *tokens = self.result.tolist()  # the step's one host read
        return tokens[: n + 1]

    def _step(self) -> None:
        buffers, nodes_of = self.buffers, self.buffers.path_nodes
        tree = candidate_tokens(self.heads, self.hidden, self.root, buffers, self.topk)  # (1+N,)
        self.cache.slots = self.length + self.slot_offsets
        mask = device_mask(self.length, buffers.tree_mask, buffers.tree_position_ids, self.cache.capacity, None)
        positions = (self.length + buffers.tree_position_ids)[None]
        out = self.base.model.run(tree[None], positions, mask, self.cache)[0]  # (1+N, H)
        logits = self.base.lm_head(out)  # (1+N, V): the base's logits after each node
        row, n = accept(tree, logits, nodes_of, buffers.path_valid, *self.acceptance)
        nodes = nodes_of.index_select(0, row)[0]  # (D+1,) the winning path, root first
        self.cache.keep_on_device(self.length, nodes, self.packed)  # slots past length + n are never attended
        last = nodes.index_select(0, n)  # (1,) the last accepted node
        self.result.copy_(torch.cat([n, tree[nodes]]))
        self.hidden.copy_(out.index_select(0, last))
        self.root.copy_(draw(logits.index_select(0, last), self.acceptance[0], self.generator))
