"""Shared checks for the per-family parity tests: tiny random HF model → save_pretrained → our from_pretrained.

Everything is float32 on the CPU; HF runs its eager attention (the reference numerics of MODELS.md §0).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers

from liger_models import AutoLigerForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_hf(config_cls, **overrides) -> transformers.PreTrainedModel:
    """A tiny random HF causal LM in float32 with eager attention."""
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma); perturb them so norm weights are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf(model, directory: Path, max_shard_size: str | None = None, v4_style: bool = False) -> Path:
    """HF save_pretrained; v4_style rewrites config.json the way transformers 4.x wrote it (rope_scaling + type)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if v4_style:
        path = directory / "config.json"
        cfg = json.loads(path.read_text())
        rope = dict(cfg.pop("rope_parameters", None) or {})
        cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", "default")
        cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
        cfg["torch_dtype"] = cfg.pop("dtype", "float32")
        path.write_text(json.dumps(cfg))
    return directory


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max(max |b|, 1e-6)."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def check_parity(hf, directory: Path, seq_len: int, *, batch: int = 1, position_ids: torch.Tensor | None = None,
                 grads: bool = True, ours=None):
    """Logits, loss and every parameter's gradient equal HF's. Returns ours.

    The truth is HF run in float64. Ours (float32) must be within 1e-4 of it (absolute for logits, relative to the
    tensor's max for gradients, 1e-5 relative for the loss) — or, where the case is so ill-conditioned that HF's own
    float32 run is further off than that (random q/k biases can saturate a softmax), within 2× HF float32's error.
    Comparing float32 to float32 instead made the test fail on seeds where ours was the more accurate of the two.
    """
    ours = ours or AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    truth = copy.deepcopy(hf).double()
    vocab = hf.config.vocab_size
    ids = torch.randint(3, vocab, (batch, seq_len))
    labels = ids.clone()
    labels[0, : seq_len // 3] = -100  # some ignored targets
    kwargs = {} if position_ids is None else {"position_ids": position_ids}

    def bound(hf_error: float, floor: float) -> float:
        return max(floor, 2 * hf_error)

    with torch.no_grad():
        exact = truth(ids, use_cache=False, **kwargs).logits
        hf_err = (hf(ids, use_cache=False, **kwargs).logits.double() - exact).abs().max().item()
        err = (ours(ids, **kwargs).logits.double() - exact).abs().max().item()
    assert err <= bound(hf_err, 1e-4), f"logits differ from float64 HF by {err:.3e} (HF float32: {hf_err:.3e})"
    if not grads:
        return ours
    losses = {}
    for tag, model, extra in (("truth", truth, {"use_cache": False}), ("hf", hf, {"use_cache": False}),
                              ("ours", ours, {})):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels, **extra, **kwargs).loss
        loss.backward()
        losses[tag] = loss.item()
    scale = max(1.0, abs(losses["truth"]))
    loss_err, hf_loss_err = abs(losses["ours"] - losses["truth"]), abs(losses["hf"] - losses["truth"])
    assert loss_err <= bound(hf_loss_err, 1e-5 * scale), losses
    exact_params, hf_params = dict(truth.named_parameters()), dict(hf.named_parameters())
    names = [n for n, _ in ours.named_parameters()]
    assert set(names) <= set(exact_params), f"names HF does not have: {set(names) - set(exact_params)}"
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        exact_grad = exact_params[name].grad
        rel, hf_rel = max_rel(p.grad.double(), exact_grad), max_rel(hf_params[name].grad.double(), exact_grad)
        assert rel <= bound(hf_rel, 1e-4), \
            f"{name}: gradient differs from float64 HF by {rel:.3e} relative to its max (HF float32: {hf_rel:.3e})"
    return ours


def check_roundtrip(ours, directory: Path, seq_len: int = 10, max_shard_size: str = "5GB") -> None:
    """Our save_pretrained loads into transformers with logits identical to ours."""
    ours.save_pretrained(directory, max_shard_size=max_shard_size)
    back = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = torch.randint(3, ours.config.vocab_size, (2, seq_len))
    with torch.no_grad():
        err = (back(ids).logits - ours(ids).logits).abs().max().item()
    assert err <= 1e-4, f"transformers reloading our checkpoint differs by {err:.3e}"
