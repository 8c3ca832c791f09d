"""A LoRA adapter on lm_head inside the fused linear-cross-entropy: the labelled forward never forms the B·T×V logits
(the adapter's u·Bᵀ is the loss's low-rank term), and its loss and every adapter gradient match float64 HF + PEFT.

"Never formed" is watched at the dispatcher: a TorchDispatchMode sees every tensor any op returns during the forward
and backward, and no tensor may hold V columns for as many rows as the batch has tokens. A 4-row logits budget keeps
the op's own chunk scratch below that, and the same watch over the formed-logits path (what a head the loss cannot
read still takes) must catch it, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import liger_models.kernels.ops.fused_linear_cross_entropy as flce
from liger_models.lora import LoraSettings, add_lora
from liger_models.modules.causal_lm import LigerForCausalLM
from liger_models.modules.lora_linear import LoraLinear

from ..helpers import INTERPRETER_ONLY, rel_l2
from ..models.parity import causal_lm_loss, max_rel
from .common import batch, pair, peft_float64, peft_name

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "lm_head"]


class _LogitsWatch(TorchDispatchMode):
    """Records every tensor an op returns in memory of its own (not a view of an argument, such as Wᵀ) that holds
    as many elements as ``rows`` rows of ``vocab`` logits: in any shape but the head weight's (its bf16 copy under
    autocast), or with ``vocab`` columns."""

    def __init__(self, vocab: int, rows: int, weight_shape: tuple = ()):
        super().__init__()
        self.vocab, self.rows, self.weight_shape, self.formed, self.ops = vocab, rows, weight_shape, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                 if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in given:
                continue
            columns = t.dim() >= 1 and t.shape[-1] == self.vocab and t.numel() // self.vocab >= self.rows
            large = t.untyped_storage().nbytes() >= self.rows * self.vocab * t.element_size()
            if columns or (large and tuple(t.shape) != self.weight_shape):
                self.formed.append((str(func), tuple(t.shape)))
        return out


def _adapted(family, tmp_path, **lora_kw):
    # V = 515: the tiny models' other activations (64 hidden, 192 packed gate|up per token) are narrower than a row
    # of logits, so a tensor the size of the batch's logits can only be logits
    hf, ours, _ = pair(family, tmp_path, tie_word_embeddings=False, vocab_size=515)
    add_lora(ours, LoraSettings(**{"r": 4, "alpha": 8, "targets": TARGETS, "init": False, **lora_kw}))
    assert isinstance(ours.lm_head, LoraLinear) and ours.lm_head.has_adapter
    return hf, ours


def _watched_step(ours, ids, labels, tune):
    """Labelled forward + backward under the watch, with 4-row loss chunks and lm_head never called."""
    vocab = ours.config.vocab_size
    tune(flce, logits_budget_bytes=4 * vocab * 4)
    watch = _LogitsWatch(vocab, ids.numel(), tuple(ours.lm_head.weight.shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ours.lm_head, "forward", lambda *a, **k: pytest.fail("lm_head was called: logits formed"))
        with watch:
            loss = ours(ids, labels=labels).loss
            loss.backward()
    return loss, watch


def _check_adapted_head(family, tmp_path, tune, device):
    hf, ours = _adapted(family, tmp_path)
    truth = peft_float64(hf, ours, tmp_path)
    ours.to(device).train()
    truth.to(device).train()
    ids, labels = (t.to(device) for t in batch())
    loss, watch = _watched_step(ours, ids, labels, tune)
    assert watch.ops > 100 and watch.formed == [], watch.formed[:3]
    exact = truth(input_ids=ids, use_cache=False).logits
    ref = causal_lm_loss(exact, labels)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    ref.backward()
    truth_params = dict(truth.named_parameters())
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert {"lm_head.lora_A.weight", "lm_head.lora_B.weight"} <= set(grads)
    for name, grad in grads.items():
        assert grad is not None, f"{name}: no gradient"
        assert max_rel(grad, truth_params[peft_name(name)].grad) < 1e-4, name
    assert not [n for n, p in ours.named_parameters() if not p.requires_grad and p.grad is not None]


@INTERPRETER_ONLY  # elsewhere CPU tensors take the loss's reference path, which forms the logits
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])  # gemma2: the final logit softcap in the loss
def test_adapted_head_loss_is_fused_and_matches_float64_hf_peft(family, tmp_path, tune):
    """Loss within 1e-5 relative and every trained gradient (q, v and lm_head adapters) within 1e-4 of its max against
    float64 HF + PEFT (the bar of assert_matches_float64_peft); no tensor of B·T rows × V columns ever existed; the
    head's frozen weight got no gradient."""
    _check_adapted_head(family, tmp_path, tune, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gpu_adapted_head_loss_is_fused_and_matches_float64_hf_peft(family, tmp_path, tune):
    """The same on the GPU, through the compiled kernels."""
    _check_adapted_head(family, tmp_path, tune, "cuda")


def test_the_watch_catches_formed_logits(tmp_path, tune, monkeypatch):
    """The same watched step through the formed-logits path (the only path for an adapted head before the low-rank
    term) records the B·T×V logits: the watch above can fail."""
    _, ours = _adapted("llama", tmp_path)
    monkeypatch.setattr(LigerForCausalLM, "_fused_head_operands", lambda self, hidden: None)
    ids, labels = batch()
    with pytest.raises(pytest.fail.Exception, match="lm_head was called"):
        _watched_step(ours, ids, labels, tune)
    watch = _LogitsWatch(ours.config.vocab_size, ids.numel())
    with watch:
        ours(ids, labels=labels).loss.backward()
    assert (ids.shape[0], ids.shape[1], ours.config.vocab_size) in [shape for _, shape in watch.formed]


def test_logits_with_loss_are_the_adapted_heads(tmp_path, tune):
    """logits_with_loss returns the adapted head's logits (those lm_head computes, those of float64 HF + PEFT) while
    the loss still runs fused."""
    hf, ours = _adapted("gemma2", tmp_path)
    truth = peft_float64(hf, ours, tmp_path).eval()
    ours.eval()
    ids, labels = batch()
    with torch.no_grad():
        called = ours(ids).logits
        exact = truth(input_ids=ids, use_cache=False).logits
    ours.logits_with_loss = True
    vocab = ours.config.vocab_size
    tune(flce, logits_budget_bytes=4 * vocab * 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ours.lm_head, "forward", lambda *a, **k: pytest.fail("lm_head was called"))
        out = ours(ids, labels=labels)
    assert out.logits.shape == called.shape and not out.logits.requires_grad
    assert (out.logits.double() - exact).abs().max().item() <= 1e-4 * max(1.0, exact.abs().max().item())
    assert max_rel(out.logits, called) <= 1e-5
    assert abs(out.loss.item() - causal_lm_loss(exact, labels).item()) <= 1e-5 * out.loss.item()


def test_head_adapter_dropout_in_the_fused_loss(tmp_path, tune):
    """With lora_dropout the loss and the head adapter's gradients are those of logits h·Wᵀ + s·(drop(h)·Aᵀ)·Bᵀ in
    float64 under the same mask (replayed from the seed: the head's dropout is the forward's only random draw), and
    logits_with_loss returns the logits of that mask."""
    _, ours = _adapted("llama", tmp_path, targets=["lm_head"], dropout=0.5)
    ours.train()
    ours.logits_with_loss = True
    head = ours.lm_head
    ids, labels = batch()
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    out = ours(ids, labels=labels)
    out.loss.backward()
    torch.manual_seed(seed)
    with torch.no_grad():
        hidden = ours.model(ids).double()
        mask = F.dropout(torch.ones_like(hidden), head.lora_dropout, True)
    assert (mask == 0).any() and (mask != 0).any()
    a64, b64 = (p.detach().double().requires_grad_() for p in (head.lora_A.weight, head.lora_B.weight))
    logits = hidden @ head.weight.double().t() + head.scaling * (hidden * mask) @ a64.t() @ b64.t()
    ref = causal_lm_loss(logits, labels)
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert max_rel(head.lora_A.weight.grad, a64.grad) < 1e-4
    assert max_rel(head.lora_B.weight.grad, b64.grad) < 1e-4
    assert max_rel(out.logits, logits.detach()) < 1e-5


@INTERPRETER_ONLY
def test_adapted_head_under_autocast(tmp_path, tune):
    """Under bf16 autocast (float32 parameters and adapters, as AMP trains) the loss still runs fused, its operands in
    bf16 as the head's GEMMs would run, and the adapter's gradients arrive in float32. The bar is the protocol's bf16
    one (tests/helpers.py assert_matches): relative error against float64 HF + PEFT at most twice HF + PEFT's own
    under the same autocast, or one bf16 rounding (4e-3). HF + PEFT round the head's logits in another order (the
    adapter's product, its scaling and the sum each in bf16), so for the scalar loss the two errors are independent
    draws of like size: measured 6e-5 to 9e-4 for ours, 6e-5 to 7e-4 for HF + PEFT, their ratio up to 2.5."""
    hf, ours = _adapted("llama", tmp_path)
    truth = peft_float64(hf, ours, tmp_path / "float64")
    peer = peft.PeftModel.from_pretrained(hf, tmp_path / "float64" / "adapter", is_trainable=True)
    for model in (ours, truth, peer):
        model.train()
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, watch = _watched_step(ours, ids, labels, tune)
        peer_loss = causal_lm_loss(peer(input_ids=ids, use_cache=False).logits.float(), labels)
    peer_loss.backward()
    assert watch.formed == [], watch.formed[:3]
    exact = causal_lm_loss(truth(input_ids=ids, use_cache=False).logits, labels)
    exact.backward()
    loss_err, peer_err = (abs(x.item() - exact.item()) / exact.item() for x in (loss, peer_loss))
    assert loss_err <= max(2 * peer_err, 4e-3), (loss.item(), peer_loss.item(), exact.item())
    truth_params, peer_params = dict(truth.named_parameters()), dict(peer.named_parameters())
    for name in ("lm_head.lora_A.weight", "lm_head.lora_B.weight"):
        grad = dict(ours.named_parameters())[name].grad
        ref = truth_params[peft_name(name)].grad
        assert grad.dtype == torch.float32, name
        err, peer_grad_err = rel_l2(grad, ref), rel_l2(peer_params[peft_name(name)].grad, ref)
        assert err <= max(2 * peer_grad_err, 4e-3), (name, err, peer_grad_err)


@pytest.mark.parametrize("case", ["dora", "hooked", "merged"])
def test_heads_the_loss_cannot_read_form_their_logits(tmp_path, case):
    """DoRA on lm_head (a per-row factor on the base's logits too) and a head with a forward hook (which reading its
    weights would skip) take the formed-logits path; a merged adapter is part of the weight, read as a plain head."""
    _, ours = _adapted("llama", tmp_path, use_dora=case == "dora")
    calls = []
    if case == "hooked":
        ours.lm_head.register_forward_hook(lambda *a: calls.append(1))
    if case == "merged":
        ours.lm_head.merge()
    hidden = torch.randn(2, 3, ours.config.hidden_size)
    operands = ours._fused_head_operands(hidden)
    if case == "merged":
        assert operands is not None and operands[3] is None and operands[1] is ours.lm_head.weight
        return
    assert operands is None
    ids, labels = batch()
    with torch.no_grad():
        loss = ours(ids, labels=labels).loss
        want = causal_lm_loss(ours(ids).logits, labels)
    assert abs(loss.item() - want.item()) <= 1e-5 * want.item()
    assert calls == ([1, 1] if case == "hooked" else [])
