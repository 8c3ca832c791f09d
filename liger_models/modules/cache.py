"""KV cache for incremental decoding: per layer, keys and values after RoPE in preallocated (B, Hkv, capacity, D)."""

from __future__ import annotations

import torch


class KVCache:
    """Grows by doubling when a call writes past its capacity; ``update`` returns views up to the filled length."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def seq_length(self) -> int:
        """Tokens cached so far (layer 0's count, so it is the past length during a forward call)."""
        return self._layers[0][2] if 0 in self._layers else 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, Hkv, T, D); return all cached keys and values (B, Hkv, past + T, D)."""
        keys, values, length = self._layers.get(layer_idx, (None, None, 0))
        end = length + k.shape[2]
        if keys is None or end > keys.shape[2]:
            size = max(end, self.capacity, 2 * (0 if keys is None else keys.shape[2]))
            grown = [t.new_empty(t.shape[0], t.shape[1], size, t.shape[3]) for t in (k, v)]
            if keys is not None:
                grown[0][:, :, :length], grown[1][:, :, :length] = keys[:, :, :length], values[:, :, :length]
            keys, values = grown
        keys[:, :, length:end], values[:, :, length:end] = k, v
        self._layers[layer_idx] = (keys, values, end)
        return keys[:, :, :end], values[:, :, :end]

    def keep(self, start: int, indices: torch.Tensor) -> None:
        """Of the entries from ``start`` on, keep those at ``start + indices``, in that order, and drop the rest.

        Speculative decoding appends a whole tree of candidates, then keeps the accepted path (``indices`` into
        the tree, root first); the next call then sees exactly the committed tokens."""
        if not self._layers:
            return
        n = len(indices)
        check_kept(start, indices, self.seq_length())  # every layer holds as many: one check (a host read)
        src = indices.to(self._layers[0][0].device) + start
        for layer_idx, (keys, values, _) in self._layers.items():
            # Advanced indexing reads into a new tensor first, so overlapping source and destination are safe.
            keys[:, :, start: start + n], values[:, :, start: start + n] = keys[:, :, src], values[:, :, src]
            self._layers[layer_idx] = (keys, values, start + n)


def check_kept(start: int, indices: torch.Tensor, filled: int) -> None:
    """Refuse keeping entries outside start … filled − 1: past them the buffer holds stale or unwritten memory, and
    a negative index would wrap around to committed entries (one host read; a speculative step makes one anyway)."""
    if len(indices) == 0:
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(indices)).tolist())
    if low < 0 or start + high >= filled or start + len(indices) > filled:
        raise ValueError(f"keep({start}, indices {low} … {high}) reaches outside the {filled} filled entries")
