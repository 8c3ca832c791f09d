"""Which candidate path a Medusa step keeps, and the base's next token, in device ops only.

Nothing here reads a value back to the host, so the eager steps (decoding.py) and the steps replayed whole as one
CUDA graph (graphed_step.py) run the same code and, given the same generator, draw the same tokens.

Rules (docs/medusa.md#tree-decoding), for a candidate token x at some depth of a path, p = softmax(base logits after
its parent / T):
  greedy (temperature T = 0): x is accepted iff it is the base's argmax there;
  typical (T > 0): iff p(x) > min(ε, δ·exp(−H(p))) (posterior_threshold ε, posterior_alpha δ).
A path keeps its longest accepted prefix; the longest wins, ties broken by the summed log-probability of the
accepted tokens (typical) or by path order (greedy, where equally long accepted prefixes hold the same tokens).
"""

from __future__ import annotations

import torch


def draw(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The base's next token for each row of logits (..., V): the argmax at temperature 0, else a draw from
    softmax(logits / temperature).

    The draw is an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with probability
    p_i (E_i / p_i is exponential with rate p_i; the smallest of such is i with probability p_i / Σ p). It is one
    fixed chain of kernels with no host-side check, which a CUDA graph can capture."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    # A zero wait would make 0 / 0 = NaN, which argmax ranks first: a token of probability 0 could win.
    return (probs / race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(-1)


def accept(tokens: torch.Tensor, logits: torch.Tensor, path_nodes: torch.Tensor, path_valid: torch.Tensor,
           temperature: float, posterior_threshold: float, posterior_alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, n) on the device: each sequence's winning path (its row in path_nodes) and accepted candidate count,
    both (B,) for B sequences, (1,) for one.

    tokens (B, N) or (N,): the tree's node tokens; logits (B, N, V) or (N, V): the base's logits after each node;
    path_nodes (P, D+1): each root-to-leaf path's nodes, root first; path_valid (P, D+1): False past a shorter
    path's end (never accepted)."""
    if tokens.dim() == 1:
        tokens, logits = tokens[None], logits[None]
    parents = path_nodes[:, :-1]  # (P, D)
    candidates = tokens[:, path_nodes[:, 1:]]  # (B, P, D)
    if temperature == 0:
        ok = candidates == logits.argmax(-1)[:, parents]
    else:
        # Per node, not per path position: a node is the parent on several paths (the default tree: 45 nodes,
        # 16 paths × 4 positions), and each row is V floats.
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, N, V)
        # p·log p is 0 at p = 0: a -inf logit (a masked token) would otherwise make the entropy NaN (0 · -inf) and
        # reject every candidate after that node.
        entropy = -torch.where(torch.isneginf(logp), 0.0, logp.exp() * logp).sum(-1)
        threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # (B, N)
        sequence = torch.arange(len(tokens), device=tokens.device)[:, None, None]
        candidate_logp = logp[sequence, parents, candidates]  # (B, P, D)
        ok = candidate_logp.exp() > threshold[:, parents]
    accepted = torch.cumprod((ok & path_valid[:, 1:]).long(), dim=-1)  # (B, P, D): 1 up to the first rejection
    lengths = accepted.sum(-1)  # (B, P)
    n = lengths.max(-1).values
    if temperature == 0:
        return lengths.argmax(-1), n  # the first row of maximal length
    score = torch.where(accepted.bool(), candidate_logp, 0.0).sum(-1)  # the accepted tokens' log-probability
    # With n = 0 every row scores 0 and the first wins, as greedy.
    return score.masked_fill(lengths != n[:, None], float("-inf")).argmax(-1), n
