"""Shared pieces of the Medusa tests: a tiny base model and a materialised-logits float64 reference of the loss."""

from __future__ import annotations

import copy
import torch
import torch.nn.functional as F
from torch import nn

from liger_models.llama.config import LlamaConfig
from liger_models.llama.modeling import LigerLlamaForCausalLM

IGNORE = -100


def make_base(vocab: int = 37, hidden: int = 16, dtype=torch.float32, *, layers: int = 1, tied: bool = False):
    """A tiny random LigerLlamaForCausalLM (HF init scaled up so logits are not all near zero)."""
    config = LlamaConfig.tiny(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                              num_hidden_layers=layers, tie_word_embeddings=tied, initializer_range=0.3)
    return LigerLlamaForCausalLM.from_config(config, dtype=dtype)


def packed_batch(B: int, T: int, vocab: int, *, packed: bool, ignore_frac: float = 0.2):
    """Random ids / HF-aligned labels (some ignored) and position_ids restarting at random document starts.

    Redrawn until some next-token target is predicted from a query that sees two different tokens of its document:
    the attention's softmax passes no gradient to a query whose keys and values are all alike (it sees only itself,
    or a document such as [3, 3]), so a batch whose every target sat on such a query would leave q_proj's (and
    k_proj's) gradient exactly zero, which no relative tolerance can check (CI seeds 1440773675 and 1835088267 drew
    one each)."""
    while True:
        ids = torch.randint(0, vocab, (B, T))
        labels = ids.clone()
        labels[torch.rand(B, T) < ignore_frac] = IGNORE
        pos = torch.arange(T).repeat(B, 1)
        if packed:
            for b in range(B):
                for start in sorted(torch.randperm(T - 2)[:2].add(1).tolist()):
                    pos[b, start:] = torch.arange(T - start)
        if some_target_attends(ids, reference_targets(labels, 1, pos), pos):
            return ids, labels, pos


def some_target_attends(ids: torch.Tensor, targets: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether some non-ignored target is predicted from a query whose document so far holds two different tokens,
    so that the attention's q/k gradients carry signal (see packed_batch)."""
    B, T = ids.shape
    return any(targets[b, t] != IGNORE and ids[b, t - pos[b, t]:t + 1].unique().numel() > 1
               for b in range(B) for t in range(T))


def reference_targets(labels: torch.Tensor, shift: int, pos: torch.Tensor | None) -> torch.Tensor:
    """labels[t + shift] when it is in the same document (positions advance by exactly `shift`), else ignored."""
    B, T = labels.shape
    out = torch.full_like(labels, IGNORE)
    for b in range(B):
        for t in range(T - shift):
            if pos is None or pos[b, t + shift] - pos[b, t] == shift:
                out[b, t] = labels[b, t + shift]
    return out


def reference_heads_z(hidden: torch.Tensor, head_sd: dict, num_heads: int, num_layers: int) -> list[torch.Tensor]:
    """ResBlock outputs from the raw state dict, one layer at a time (independent of the fused GEMM path)."""
    zs = []
    for h in range(num_heads):
        z = hidden
        for l in range(num_layers):
            z = z + F.silu(z @ head_sd[f"{h}.{l}.linear.weight"].t() + head_sd[f"{h}.{l}.linear.bias"])
        zs.append(z)
    return zs


def reference_loss(base64: nn.Module, head_sd64: dict, cfg, ids, labels, pos, *, w0: float, scales, stage: int):
    """float64 Medusa loss with every logit materialised: (loss, base CE, head CEs, top1, top5, counts)."""
    with torch.set_grad_enabled(stage == 2):
        hidden = base64.model(ids, position_ids=pos)
    W_base = base64.lm_head.weight
    total = torch.zeros((), dtype=torch.float64)
    base_ce = None
    if w0:
        t0 = reference_targets(labels, 1, pos)
        base_ce = F.cross_entropy((hidden @ W_base.t()).flatten(0, 1), t0.flatten(), ignore_index=IGNORE)
        total = total + w0 * base_ce
    ces, top1, top5, count = [], [], [], []
    for k, z in enumerate(reference_heads_z(hidden, head_sd64, cfg.num_heads, cfg.num_layers)):
        W = W_base.detach() if cfg.share_lm_head else head_sd64[f"{k}.{cfg.num_layers}.weight"]
        logits = (z @ W.t()).flatten(0, 1)
        t = reference_targets(labels, k + 2, pos).flatten()
        valid = t != IGNORE
        ce = F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="sum") / valid.sum().clamp(min=1)
        total = total + scales[k] * ce
        ces.append(ce.detach())
        tl = logits.gather(1, t.clamp(min=0)[:, None])
        rank = (logits > tl).sum(1)
        top1.append(((rank == 0) & valid).sum())
        top5.append(((rank < 5) & valid).sum())
        count.append(valid.sum())
    return total, base_ce, torch.stack(ces), torch.stack(top1), torch.stack(top5), torch.stack(count)


def float64_copies(base: nn.Module, heads: nn.Module):
    """float64 CPU copies of the base and of the heads' state dict (leaves with grads), for the reference."""
    base64 = copy.deepcopy(base).cpu().double()
    sd64 = {k: v.detach().cpu().double().requires_grad_() for k, v in heads.state_dict().items()}
    return base64, sd64


def accept_paths(paths: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor, temperature: float,
                 posterior_threshold: float, posterior_alpha: float) -> tuple[int, int]:
    """acceptance.accept on candidate rows given path by path: tokens paths (P, D+1), the base's logits after each
    position (P, D+1, V). The rows become a tree whose paths share no node (node p·(D+1) + d), which the rule
    reads the same way, since a node's acceptance depends only on its parent's logits and its own token."""
    from liger_models.medusa.acceptance import accept

    nodes = torch.arange(paths.numel()).view(paths.shape)
    row, n = accept(paths.flatten(), logits.flatten(0, 1), nodes, valid, temperature, posterior_threshold,
                    posterior_alpha)
    return int(row), int(n)
