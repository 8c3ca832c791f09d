"""Medusa steps replayed whole as one CUDA graph each: heads, candidates, verification, acceptance, compaction.

Run eagerly, a batch-1 step is bounded by the host: besides the base's calls, the heads' ResBlocks and projection,
top-k, the tree's gather, the acceptance and the cache compaction are ~40 launches and a few host reads. Every
input a step needs is on the device, so here the whole step is one graph, for greedy and for typical acceptance:

  state (on the device, static):  hidden (1, H) the last committed token's final hidden state; root (1,) the base's
                                  next token after it (argmax, or drawn from the generator); length () the committed
                                  token count, set by the host after a prefill or a root-only step
  one replay:                     proposals = heads' top-k on hidden → node tokens → the tree-masked base call at
                                  slots length … → the winning path and its accepted prefix (acceptance.accept) →
                                  its keys and values packed down to slots length … → result = (n, path tokens), the
                                  new hidden / root (those after the last accepted node) and length += n + 1

The host reads ``result`` (one device-to-host copy per step, into pinned memory) to extend the output, stop at EOS
and check the rotary table; since a replay needs nothing from the host, the next one can be queued before that read
(``tree(..., ahead=True)``). The step's ops are those of the eager path (``decoding._Steps``) and the draws come
from the same generator in the same order (a graph replay advances a registered generator as the eager kernels
would), so the tokens match it: greedy, they are plain greedy decoding's.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_models.medusa.acceptance import accept, draw
from liger_models.medusa.heads import MedusaHeads, base_logits
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
        # Greedy steps draw nothing: a generator (on whatever device) must not be registered with the graph.
        self.acceptance, self.generator = acceptance, generator if acceptance[0] > 0 else None
        self.cache = StaticKVCache(capacity)
        self.one_token = GraphedCall.one_token(base, self.cache, 1)  # a step whose tree would span two rotary tables
        self.graphed = self.one_token.graphed
        self.slot_offsets = torch.arange(len(buffers.tree_indices), device=device)
        self.packed = torch.arange(buffers.depth + 1, device=device)
        self.hidden: torch.Tensor | None = None  # (1, H), allocated by the first prefill
        self.root = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.result = torch.zeros(buffers.depth + 2, dtype=torch.long, device=device)  # n, then the path's D+1 tokens
        self._init_launches()

    def _init_launches(self) -> None:
        """What ``_launch`` / ``_read`` keep, once ``graphed`` and ``result`` are set."""
        self.graph: torch.cuda.CUDAGraph | None = None
        # Replayed steps copy their result here, two in turn: one step may be queued behind the one being read.
        self.landing = [torch.zeros_like(self.result, device="cpu", pin_memory=True) for _ in range(2)
                        ] if self.graphed else []
        self.launches = 0
        self.queued: tuple[int, object] | None = None  # (start slot, handle) of a step launched ahead

    def prefill(self, ids: torch.Tensor) -> None:
        """The base on ids (1, T) from an empty cache (eagerly), copied into the static cache; the state after it."""
        self._refuse_queued("prefill")
        cache = KVCache()
        hidden = self.base.model(ids, cache=cache)[:, -1]
        self.cache.load(cache)
        self._set_state(hidden, base_logits(self.base, hidden))

    def _set_state(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        if self.hidden is None:
            self.hidden = torch.empty_like(hidden)  # the graph reads this tensor: it is refilled, never replaced
        self.hidden.copy_(hidden)
        self.root.copy_(draw(logits, self.acceptance[0], self.generator))

    def root_only(self, length: int) -> list[int]:
        """Emit the root alone at slot ``length`` (one-token graphed call) and move the state past it."""
        self._refuse_queued("root_only")
        root = self.root.clone()
        hidden, logits = self.one_token(root[None], length, length)
        self._set_state(hidden[:, 0], logits[:, 0])
        return root.tolist()

    def tree(self, length: int, ahead: bool = False) -> list[int]:
        """One Medusa step after ``length`` committed tokens: the root and the accepted candidates.

        ahead: the caller's next call is a tree step too (after this step's tokens), unless it stops. That step is
        then launched before this one's tokens are read, from the state this one leaves on the device, so the GPU
        goes from one step to the next while the host reads (a host read per step otherwise leaves the GPU idle for
        the host's turn of the loop). The caller must not call ``prefill`` or ``root_only`` next."""
        tree_size, capacity = len(self.slot_offsets), self.cache.capacity
        if self.queued is not None:
            start, current = self.queued
            if start != length:
                raise RuntimeError(f"the step launched ahead starts at slot {start}, not {length}")
            self.queued = None
        else:
            if length + tree_size > capacity:  # inside the graph it would be a device assert
                raise ValueError(f"a tree at slots {length} … {length + tree_size - 1} passes the static cache's "
                                 f"{capacity}")
            self.length.fill_(length)
            current = self._launch()
        # The next step starts at most depth + 1 slots further; past the cache it must not be launched blindly.
        launch_next = ahead and length + self.buffers.depth + 1 + tree_size <= capacity
        following = self._launch() if launch_next else None
        n, *tokens = self._read(current)
        if following is not None:
            self.queued = (length + n + 1, following)
        return tokens[: n + 1]

    def _launch(self) -> object:
        """Run one step (the graph's warm-up and capture the first time, a replay after) from the state on the
        device, without waiting for it; a handle for ``_read``."""
        if not self.graphed:
            self._step()
            return self.result.clone()  # a step launched after this one overwrites ``result``
        captured_now = self.graph is None
        if captured_now:  # the warm-up is this step; the capture only records it
            self.graph, _ = warm_up_and_capture(self._step, self.root.device, self.generator)
        landing = self.landing[self.launches % 2]
        self.launches += 1
        with torch.cuda.device(self.root.device):
            if not captured_now:
                self.graph.replay()
            landing.copy_(self.result, non_blocking=True)  # queued before any later step rewrites ``result``
            landed = torch.cuda.Event()
            landed.record()
        return landing, landed

    def _read(self, handle: object) -> list[int]:
        """(n, the path's D+1 tokens) of a launched step: the one host read per step."""
        if not self.graphed:
            return handle.tolist()
        landing, landed = handle
        landed.synchronize()
        return landing.tolist()

    def _refuse_queued(self, call: str) -> None:
        if self.queued is not None:  # that step has moved the state on: this call would run on the wrong one
            raise RuntimeError(f"{call} after a tree step launched ahead")

    def _step(self) -> None:
        buffers, nodes_of = self.buffers, self.buffers.path_nodes
        tree = candidate_tokens(self.heads, self.hidden, self.root, buffers, self.topk)[0]  # (1+N,)
        self.cache.slots = self.length + self.slot_offsets
        mask = device_mask(self.length, buffers.tree_mask, buffers.tree_position_ids, self.cache.capacity, None)
        positions = (self.length + buffers.tree_position_ids)[None]
        out = self.base.model.run(tree[None], positions, mask, self.cache)[0]  # (1+N, H)
        logits = base_logits(self.base, out)  # (1+N, V): the base's logits after each node
        row, n = accept(tree, logits, nodes_of, buffers.path_valid, *self.acceptance)
        nodes = nodes_of.index_select(0, row)[0]  # (D+1,) the winning path, root first
        self.cache.keep_on_device(self.length, nodes, self.packed)  # slots past length + n are never attended
        last = nodes.index_select(0, n)  # (1,) the last accepted node
        self.result.copy_(torch.cat([n, tree[nodes]]))
        self.hidden.copy_(out.index_select(0, last))
        self.root.copy_(draw(logits.index_select(0, last), self.acceptance[0], self.generator))
        self.length += n[0] + 1  # where a step launched ahead starts, without the host
