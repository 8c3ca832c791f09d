"""fused_linear_cross_entropy against a float64 reference (docs/kernels.md), on CPU through Triton's interpreter.

A tiny logits budget forces several token chunks (with and without grad_W's storage as the scratch), so chunk
boundaries, the fp32 dW accumulation and the final cast are all exercised. Every allocation is NaN-poisoned.
"""

from __future__ import annotations

import pytest
import torch

import liger_models.kernels.ops.fused_linear_cross_entropy as flce_mod
from liger_models.kernels.ops import _ce_core
from liger_models.kernels.ops import _grad_filter as grad_filter
from liger_models.kernels.ops.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    LossOutput,
    consume_weight_grad,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    target_rank_reference,
)
from tests.helpers import BIG_MEMORY, DEVICE, assert_matches, poison_, rel_l2

IGNORE = -100
B, T, H = 2, 7, 8  # 14 tokens: 4 chunks of a 4-row budget, or 2 chunks of H = 8 rows in grad_W's storage
# Where the logits scratch lives, and whether it is split in two so chunk i's CE pass precedes chunk i−1's gradient
# GEMMs (OVERLAP_CE; on CUDA a side stream runs it concurrently, here the same schedule runs in order).
SCRATCH_MODES = ("grad_w_scratch", "budget_scratch", "grad_w_scratch+overlap", "budget_scratch+overlap",
                 "single_chunk")  # 14 ≤ 2H rows: one chunk in the fp32 accumulator's bytes, dW straight into grad_W


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def _chunk(tune, mode):
    """A 4-row logits budget; mode picks whether grad_W's storage (H rows) may serve as the scratch instead, and
    whether the scratch is split for the overlapped schedule (then 4 or 7 chunks of 14 tokens)."""
    tune(flce_mod, grad_weight_as_scratch=mode.startswith("grad_w_scratch"))
    tune(flce_mod, overlap_ce=mode.endswith("+overlap"))
    tune(flce_mod, single_chunk_in_accumulator=mode == "single_chunk")
    tune(flce_mod, logits_budget_bytes=4 * 517 * 4)


@pytest.fixture
def chunked_once(tune):
    """The interpreter is slow: tests that are not about chunking run one mode (grad_W's storage, the default)."""
    _chunk(tune, SCRATCH_MODES[0])


def _inputs(vocab, dtype, bias=False, b=B, t=T):
    hidden = torch.randn(b, t, H, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, H, device=DEVICE) / H**0.5 * 2).to(dtype)
    labels = torch.randint(0, vocab, (b, t), device=DEVICE)
    labels[0, 0], labels[-1, -1], labels[0, 3] = 0, vocab - 1, IGNORE
    return hidden, weight, (torch.randn(vocab, device=DEVICE).to(dtype) if bias else None), labels


def _grads(fn, tensors, labels, g, u_view=None, **opts):
    """tensors: (hidden, weight, bias) or, with the low-rank term, (hidden, weight, bias, u, B), each with its
    requires_grad; u_view(u) is what the call gets as u (a view of the leaf, e.g. a strided slice)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(rg) for t, rg in tensors]
    if len(leaves) == 5:
        opts["low_rank"] = ((u_view or (lambda u: u))(leaves[3]), leaves[4])
    out = fn(*leaves[:2], labels, leaves[2], **opts)
    loss = out[0] if isinstance(out, tuple) else out
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(loss, wanted, g.to(loss.dtype)))
    return out, [next(grads) if t is not None and t.requires_grad else None for t in leaves]


def _assert_loss_of_bf16_logits(loss, ref, eager):
    """An fp32 loss computed from bf16 logits (HF's numerics) is as far from the exact one as the bf16 rounding of
    the logits makes it: within 2× eager PyTorch's error on the same bf16 inputs. (Per token, that rounding alone is
    up to |z|·2⁻⁹, far above any fixed rtol once logits reach ±16.)"""
    err, eager_err = rel_l2(loss, ref), rel_l2(eager, ref)
    assert err <= 2 * eager_err + 1e-6, f"loss: rel err {err:.3e} > 2x eager's {eager_err:.3e}"


def _check(hidden, weight, bias, labels, *, requires=(True,) * 5, low_rank=(), **opts):
    """Loss, rank and the gradients of hidden / weight / bias (and of the low-rank term's u / B when low_rank is
    given: (u, B)) vs float64 (and eager in the input dtype)."""
    tensors = list(zip((hidden, weight, bias, *low_rank), requires))
    out, grads = _grads(fused_linear_cross_entropy, tensors, labels, _incoming(opts, labels), **opts)
    t64 = [(None if t is None else t.double(), rg) for t, rg in tensors]
    out64, grads64 = _grads(fused_linear_cross_entropy_reference, t64, labels, _incoming(opts, labels), **opts)
    eager, grads_eager = _grads(fused_linear_cross_entropy_reference, tensors, labels, _incoming(opts, labels),
                                **opts)
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    loss, loss64 = first(out), first(out64)
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    if hidden.dtype == torch.float32:
        assert_matches(loss, loss64, name="loss")
    else:
        _assert_loss_of_bf16_logits(loss, loss64, first(eager))
    for name, got, ref, eager, (t, _) in zip(("dh", "dW", "db", "du", "dB"), grads, grads64, grads_eager, tensors):
        if ref is None:
            assert got is None, name
            continue
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert_matches(got, ref, eager=eager, name=name)
    return out, out64


_G = {}


def _incoming(opts, labels):
    """One random incoming gradient per test, shared by all three runs.

    For mean / sum it is a power of two ≠ 1: backward's scaling of the forward-computed bf16 gradients then runs
    and is exact (any other factor adds one bf16 rounding, documented in the module).
    """
    key = (opts.get("reduction", "mean"), tuple(labels.shape))
    if key not in _G:
        if key[0] == "none":
            _G[key] = torch.randn(labels.shape, device=DEVICE, dtype=torch.float64)
        else:
            _G[key] = torch.tensor([0.5, -2.0, 0.25])[torch.randint(0, 3, ())].to(DEVICE, torch.float64)
    return _G[key]


@pytest.fixture(autouse=True)
def _fresh_incoming():
    _G.clear()


CASES = [
    dict(),
    dict(reduction="sum", loss_scale=0.3),
    dict(reduction="none", loss_scale=2.0),
    dict(label_smoothing=0.1, z_loss=1e-3, normalizer=40),
    dict(softcap=2.0, loss_scale=0.5),
    dict(label_smoothing=0.05, z_loss=1e-4, softcap=3.0, reduction="none"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(tune, dtype, case):
    _chunk(tune, SCRATCH_MODES[(case + (dtype == torch.bfloat16)) % len(SCRATCH_MODES)])  # every mode
    vocab = (67, 300, 517)[case % 3]
    hidden, weight, bias, labels = _inputs(vocab, dtype, bias=case % 2 == 1)
    _check(hidden, weight, bias, labels, **CASES[case])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [dict(softcap=30.0), dict(softcap=30.0, reduction="none", z_loss=1e-4)])
def test_gemma2_final_softcap_far_past_the_cap(chunked_once, dtype, opts):
    """Gemma 2's final cap (30) on logits up to ~±150: most columns sit where tanh has saturated (its derivative
    4u/(1+u)², u = e^(−2|z|/c), down to ~1e-4), others near 0 where it is ~1, and targets fall in both. Loss and
    gradients still match the float64 reference."""
    hidden, weight, bias, labels = _inputs(300, dtype, bias=True)
    weight = (weight.float() * 25).to(dtype)
    logits = torch.nn.functional.linear(hidden.float(), weight.float(), bias.float())
    assert logits.abs().max() > 90 and (logits.abs() < 15).float().mean() > 0.05  # both regimes present
    _check(hidden, weight, bias, labels, **opts)


@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", label_smoothing=0.1)])
@pytest.mark.parametrize("rows", [16, 17])
def test_single_chunk_in_accumulator(tune, monkeypatch, opts, rows):
    """bf16, N ≤ 2H: one chunk, dW by one GEMM straight into grad_W (no fp32 accumulator); N = 2H + 1: the
    accumulator path as before. Either way the result matches the float64 reference."""
    _chunk(tune, "single_chunk")
    accumulators = []
    accumulate = flce_mod._accumulate_dw
    monkeypatch.setattr(flce_mod, "_accumulate_dw", lambda acc, *a, **k: (accumulators.append(acc.dtype),
                                                                          accumulate(acc, *a, **k)))
    hidden, weight, bias, labels = _inputs(300, torch.bfloat16, bias=True, b=1, t=rows)
    _check(hidden, weight, bias, labels, **opts)
    assert set(accumulators) == ({torch.bfloat16} if rows <= 2 * H else {torch.float32})


@pytest.mark.parametrize("vocab,opts", [(301, dict()), (300, dict(reduction="none", z_loss=1e-3))])
def test_accumulator_becoming_grad(tune, monkeypatch, vocab, opts):
    """bf16 under a 3-row scratch cap (< H): five chunks accumulate dW in fp32 halves of the vocabulary, and
    grad_W is cast into the first half's own storage (odd V: one spare row); same results as the reference."""
    _chunk(tune, "budget_scratch")
    tune(flce_mod, max_scratch_bytes=3 * vocab * 2)
    casts = []
    cast = flce_mod._cast_into_grad
    monkeypatch.setattr(flce_mod, "_cast_into_grad", lambda halves, g: (casts.append(g), cast(halves, g, first=7)))
    hidden, weight, bias, labels = _inputs(vocab, torch.bfloat16, bias=True)
    _check(hidden, weight, bias, labels, **opts)
    assert len(casts) == 1
    assert casts[0].untyped_storage().nbytes() == -(-vocab // 2) * H * 4  # ≤ grad_W's bytes + one row


def test_cap_above_budget_sizes_the_scratch(tune, monkeypatch):
    """A cap below H but above the logits budget (Gemma: 1536 rows against the budget's 524) is the scratch's
    size when the accumulator becomes grad_W: chunks of cap rows, not of the smaller budget."""
    _chunk(tune, "budget_scratch")
    vocab = 300
    tune(flce_mod, logits_budget_bytes=4 * vocab * 2)
    tune(flce_mod, max_scratch_bytes=6 * vocab * 2)
    chunk_rows = []
    ce_rows = flce_mod.ce_rows
    monkeypatch.setattr(flce_mod, "ce_rows", lambda logits, *a, **k: (chunk_rows.append(logits.shape[0]),
                                                                      ce_rows(logits, *a, **k)))
    hidden, weight, bias, labels = _inputs(vocab, torch.bfloat16)
    _check(hidden, weight, bias, labels)
    assert chunk_rows == [6, 6, 2]


@pytest.mark.parametrize("budget_rows,shared", [(H, True), (H - 1, True), (H + 1, False)])
def test_scratch_in_grad_w_when_it_holds_the_budget(tune, budget_rows, shared):
    """grad_W's storage (H rows of V) is the logits scratch whenever it holds at least the budget's rows: an
    equal-sized second buffer would only add V·H bytes to the peak (Mistral: V 32768, H 4096, 256 MiB budget)."""
    vocab, n = 37, 3 * H
    tune(flce_mod, logits_budget_bytes=budget_rows * vocab * 2)
    h = torch.randn(n, H, device=DEVICE, dtype=torch.bfloat16)
    grad_w = torch.empty(vocab, H, device=DEVICE, dtype=torch.bfloat16)
    (buffer,), rows = flce_mod._scratch(n, h, vocab, grad_w, True, None)
    assert (buffer.untyped_storage().data_ptr() == grad_w.untyped_storage().data_ptr()) == shared
    assert rows == (H if shared else budget_rows)


@pytest.mark.parametrize("size", [1, 7, 8, 1000, 4099])
def test_cast_into_grad_in_place(size):
    """The doubling copies give exactly (bit for bit) the rounding of the concatenated halves."""
    vocab, hdim = size, 3
    halves, grad = flce_mod._accumulator_becoming_grad(vocab, hdim, torch.bfloat16, torch.device("cpu"))
    assert grad.untyped_storage().data_ptr() == halves[0].untyped_storage().data_ptr()
    for half in halves:
        half.copy_(torch.randn(half.shape) * 100)
    want = torch.cat(halves).to(torch.bfloat16)
    flce_mod._cast_into_grad(halves, grad, first=2)
    assert torch.equal(grad.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("requires", [(True, False, False), (False, True, True), (True, False, True)])
def test_frozen_weight_or_hidden(chunked_once, monkeypatch, requires):
    """Only the gradients asked for are computed; a frozen weight never reaches the dW GEMM."""
    if not requires[1]:
        monkeypatch.setattr(flce_mod, "_accumulate_dw", lambda *a, **k: pytest.fail("dW work for a frozen weight"))
    hidden, weight, bias, labels = _inputs(300, torch.float32, bias=True)
    _check(hidden, weight, bias, labels, requires=requires, label_smoothing=0.1)


@pytest.mark.parametrize("split_cols", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_target_rank(chunked_once, tune, dtype, reduction, split_cols):
    """"none" ranks in the forward-only pass (backward redoes the chunks), "mean" in the fused pass; 128-column
    blocks make every row's rank a sum over 5 blocks' counts, and split_cols=200 splits each row over 4 programs
    (whose ranks, sums and maxima merge; the backward-only pass of "none" runs split without meeting)."""
    tune(_ce_core, block_v=128)
    tune(_ce_core, split_cols=split_cols)
    tune(_ce_core, split_min_cols=0)
    hidden, weight, _, labels = _inputs(517, dtype)
    (_, rank), (_, _) = _check(hidden, weight, None, labels, return_target_rank=True, reduction=reduction)
    assert rank.dtype == torch.int32 and rank.shape == labels.shape
    logits = (hidden @ weight.t()).float()  # what the kernel ranks: the logits in the input dtype
    valid = labels != IGNORE
    target = logits.gather(-1, labels.clamp(min=0)[..., None])
    # A reordered (chunked) GEMM may round a logit within ~1 ulp of the target differently: only near-ties may
    # move the rank, so it must lie between the counts with a small margin either side.
    margin = 1e-5 if dtype == torch.float32 else 2e-2
    lo = (logits > target + margin * target.abs().clamp(min=1)).sum(-1)
    hi = (logits > target - margin * target.abs().clamp(min=1)).sum(-1)
    assert torch.equal(rank[~valid], torch.full_like(rank[~valid], -1))
    assert ((rank[valid] >= lo[valid]) & (rank[valid] <= hi[valid])).all()
    # top-1 of confident rows: make row 0's target the argmax by a wide margin
    weight2 = weight.clone()
    weight2[labels[0, 1]] = hidden[0, 1] * 10
    _, rank2 = fused_linear_cross_entropy(hidden, weight2, labels, return_target_rank=True)
    assert rank2[0, 1] == 0


@pytest.mark.parametrize("split_cols", [None, 200])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_target_rank_breaks_ties_like_argmax(chunked_once, tune, reduction, split_cols):
    """Tied logits rank as argmax breaks them, the first wins: a row of equal logits (a dead head at a zero hidden
    state) ranks its target at its own index, not first (strictly-above counting made such a head 100% top-1). Ties
    across 128-column blocks and, with split_cols, across the programs that share a row."""
    tune(_ce_core, block_v=128)
    tune(_ce_core, split_cols=split_cols)
    tune(_ce_core, split_min_cols=0)
    vocab = 517
    hidden, weight, _, labels = _inputs(vocab, torch.float32)
    hidden[1] = 0.0  # batch row 1: every logit exactly 0
    twins = torch.randperm(vocab, device=DEVICE)[:2 * T].view(2, T)  # T columns, each tied with another one
    weight[twins[1]] = weight[twins[0]]
    labels[0] = twins.max(0).values  # batch row 0 targets the later twin of each pair
    labels[0, 3] = IGNORE
    hidden.requires_grad_()
    _, rank = fused_linear_cross_entropy(hidden, weight, labels, return_target_rank=True, reduction=reduction)
    logits = (hidden.detach() @ weight.t()).float()
    want = target_rank_reference(logits, labels, IGNORE)
    assert torch.equal(rank, want)
    valid = labels[1] != IGNORE
    assert torch.equal(rank[1][valid], labels[1][valid].to(torch.int32))  # all tied: the target's own index
    assert (rank[0][labels[0] != IGNORE] > 0).all()  # a later twin never ranks first


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(chunked_once, reduction):
    hidden, weight, bias, labels = _inputs(67, torch.bfloat16, bias=True)
    labels.fill_(IGNORE)
    leaves = [t.detach().requires_grad_() for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], labels, leaves[2], reduction=reduction, z_loss=1e-2)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    for t in leaves:
        assert torch.equal(t.grad, torch.zeros_like(t)), "grads must be exactly zero"


@pytest.mark.parametrize("bad", [67, -5])
def test_bad_label_raises(bad):
    hidden, weight, _, labels = _inputs(67, torch.float32)
    labels[1, 2] = bad
    with pytest.raises(ValueError, match=f"label {bad} is outside"):
        fused_linear_cross_entropy(hidden, weight, labels)


def test_bad_label_never_reaches_a_weight_gradient_consumer():
    """The check's verdict arrives after the chunk kernels are queued; a consumer (an optimizer step in the
    forward) must not be handed a dW built from skipped CE passes."""
    hidden, weight, _, labels = _inputs(67, torch.float32)
    labels[0, 1] = 67
    weight.requires_grad_()
    handed = []
    forget = consume_weight_grad(weight, lambda grad, node: handed.append(grad))
    try:
        with pytest.raises(ValueError, match="label 67 is outside"):
            fused_linear_cross_entropy(hidden, weight, labels)
    finally:
        forget()
    assert handed == []


def test_bad_arguments():
    hidden, weight, _, labels = _inputs(67, torch.float32)
    with pytest.raises(ValueError, match="share one floating dtype"):
        fused_linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="do not match"):
        fused_linear_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="accum_dtype"):
        fused_linear_cross_entropy(hidden, weight, labels, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        fused_linear_cross_entropy(hidden, weight, labels, max_scratch_bytes=0)
    # a 0-dim hidden and an empty vocabulary: before, an IndexError and a ZeroDivisionError from the chunk sizing
    with pytest.raises(ValueError, match="hidden must be"):
        fused_linear_cross_entropy(hidden[0, 0, 0], weight, labels[0, 0])
    with pytest.raises(ValueError, match=r"weight must be \(V, 8\) with V >= 1, got \(0, 8\)"):
        fused_linear_cross_entropy(hidden, weight[:0], torch.full_like(labels, IGNORE))
    for reduction in ("sum", "none"):  # a normaliser there was silently unused
        with pytest.raises(ValueError, match="normalizer divides"):
            fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, normalizer=13)


@pytest.mark.parametrize("opts", [dict(normalizer=-4), dict(normalizer=torch.tensor([3.0, 4.0])),
                                  dict(z_loss=-1e-4), dict(softcap=float("inf"))])
def test_bad_option_values_raise(opts):
    """Values that gave a negative or NaN loss without a word."""
    hidden, weight, _, labels = _inputs(67, torch.float32)
    with pytest.raises(ValueError, match=next(iter(opts))):
        fused_linear_cross_entropy(hidden, weight, labels, **opts)
    if "normalizer" not in opts:
        with pytest.raises(ValueError, match=next(iter(opts))):
            FusedLinearCrossEntropyLoss(**opts)


def test_one_element_normaliser_tensor(chunked_once):
    """A (1,)-shaped count is the normaliser (a 0-dim loss), not a per-row scale read out of bounds at every row."""
    hidden, weight, bias, labels = _inputs(300, torch.float32, bias=True)
    out, _ = _check(hidden, weight, bias, labels, reduction="mean", normalizer=torch.tensor([40.0], device=DEVICE))
    assert out.shape == ()


def test_strided_hidden(chunked_once):
    """A (T, B, H) tensor seen as (B, T, H) (copied) and a row-strided slice of a wider buffer (used in place)."""
    hidden, weight, bias, labels = _inputs(300, torch.float32, bias=True)
    _check(hidden.transpose(0, 1).contiguous().transpose(0, 1), weight, bias, labels)
    wide = torch.randn(B, T, H + 5, device=DEVICE)[..., 2 : 2 + H]
    _check(wide, weight, None, labels, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_strided_labels(chunked_once, reduction):
    """Labels as a 1-D strided view (one position of each of B·T sequences), which reshape(-1) does not copy."""
    hidden, weight, bias, _ = _inputs(300, torch.float32, bias=True, b=1)
    labels = torch.randint(0, 300, (T, 3), device=DEVICE)[:, 1].view(1, T)
    labels[0, 2] = IGNORE
    assert labels.stride(1) == 3 and labels.reshape(-1).stride(0) == 3
    _check(hidden, weight, bias, labels, reduction=reduction)


def test_double_backward_raises(chunked_once):
    """create_graph=True must fail clearly, even for a constant incoming gradient (torch's once_differentiable
    passes that case through with gradients that lack their second-order terms)."""
    hidden, weight, _, labels = _inputs(67, torch.float32)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    for reduction in ("mean", "none"):
        loss = fused_linear_cross_entropy(h, w, labels, reduction=reduction).sum()
        with pytest.raises(RuntimeError, match="create_graph"):
            torch.autograd.grad(loss, (h, w), create_graph=True)


def test_bf16_accumulation_and_heads_sharing_hidden(chunked_once):
    """accum_dtype=weight dtype, and two heads on one hidden tensor via shifted labels (grads add up)."""
    hidden, weight, _, labels = _inputs(300, torch.bfloat16)
    _check(hidden, weight, None, labels, accum_dtype=torch.bfloat16)
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    loss = fused_linear_cross_entropy(h, w, labels) + fused_linear_cross_entropy(h, w, shifted, loss_scale=0.5)
    loss.backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = fused_linear_cross_entropy_reference(h64, w64, labels)
    ref = ref + fused_linear_cross_entropy_reference(h64, w64, shifted, loss_scale=0.5)
    ref.backward()
    assert_matches(loss, ref, name="loss")
    assert_matches(h.grad, h64.grad, name="dh")
    assert_matches(w.grad, w64.grad, name="dW")


def test_no_grad_module_and_second_backward():
    hidden, weight, _, labels = _inputs(67, torch.float32)
    with torch.no_grad():
        loss = FusedLinearCrossEntropyLoss(label_smoothing=0.1)(hidden, weight, labels)
    ref = fused_linear_cross_entropy_reference(hidden.double(), weight.double(), labels, label_smoothing=0.1)
    assert_matches(loss, ref, name="loss")
    w = weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(hidden, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


# ---------------------------------------------------------------------------------------------------------------
# Gradient filter (grad_filter_eps, _grad_filter.py). The data put a wide gap between the columns' gradients: a
# constant feature (hidden[..., 0] = 1) gives 40% "hot" columns logit offset 0 and the rest −14, and labels are hot
# columns only. So every hot column carries gradient ≥ eps in every chunk with a non-ignored token and every cold
# column stays far below it, whatever the chunking, and the reference (all tokens as one chunk) is the truth.
FILTER_CASES = [dict(), dict(reduction="sum", loss_scale=0.3), dict(reduction="none", loss_scale=2.0),
                dict(z_loss=1e-3, normalizer=40), dict(softcap=30.0, loss_scale=0.5)]
FILTER_MODES = ("grad_w_scratch", "budget_scratch+overlap", "single_chunk", "capped", "slabs")


def _hot_and_cold(hidden, weight, labels, share):
    """In place: hidden[..., 0] = 1 and weight[:, 0] = 0 for a random `share` of "hot" columns, −14 for the rest;
    labels not ignored are redrawn among the hot columns. Returns (labels, hot)."""
    hot = torch.rand(weight.shape[0], device=weight.device) < share
    hot[0] = hot[-1] = True
    hidden[..., 0] = 1
    weight[:, 0] = torch.where(hot, 0.0, -14.0).to(weight.dtype)
    hot_ids = hot.nonzero()[:, 0]
    labels = torch.where(labels == IGNORE, labels, hot_ids[torch.randint(0, len(hot_ids), labels.shape,
                                                                         device=labels.device)])
    return labels, hot


def _filter_inputs(dtype, bias, vocab=517):
    hidden, weight, b, labels = _inputs(vocab, dtype, bias=bias)
    weight = (weight.float() / 10).to(dtype)  # logit noise ~0.5 around each column's offset
    labels, hot = _hot_and_cold(hidden, weight, labels, 0.4)
    labels[0, 0], labels[-1, -1] = 0, vocab - 1
    return hidden, weight, None if b is None else b / 10, labels, hot


@pytest.fixture
def kept_columns(monkeypatch):
    """The column indices each sparse chunk's GEMMs ran over, in call order."""
    kept = []
    sparse = flce_mod.sparse_gradients
    monkeypatch.setattr(flce_mod, "sparse_gradients", lambda d, cols, *a: (kept.append(cols), sparse(d, cols, *a)))
    return kept


def _eps_in_the_gap(hidden, weight, bias, labels, hot, low_rank=None, **opts):
    """The geometric middle between the largest cold and the smallest hot per-token gradient (float64)."""
    ce = {k: v for k, v in opts.items() if k in ("z_loss", "softcap")}
    z = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if low_rank is not None:
        z = z + low_rank[0].double() @ low_rank[1].double().t()
    z = z.reshape(-1, weight.shape[0]).requires_grad_()
    flat = labels.reshape(-1)
    (g,) = torch.autograd.grad(flce_mod.cross_entropy_reference(z, flat, reduction="none", **ce).sum(), z)
    g = g[flat != IGNORE].abs()
    cold_max, hot_min = g[:, ~hot].max().item(), g[:, hot].min().item()
    assert hot_min > 30 * cold_max, f"the test's data lost its gap: {hot_min:.2e} vs {cold_max:.2e}"
    return (hot_min * cold_max) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(FILTER_CASES)))
def test_grad_filter_skips_cold_columns(tune, kept_columns, dtype, case):
    """Filtered gradients match the float64 reference with the same filter: cold columns get exactly zero dW and
    db and nothing of dh, hot columns everything, in every chunking mode; the kept columns went through the
    gathered (sparse) GEMMs."""
    mode = FILTER_MODES[(case + (dtype == torch.bfloat16)) % len(FILTER_MODES)]
    _chunk(tune, {"capped": "budget_scratch", "slabs": "grad_w_scratch"}.get(mode, mode))
    if mode == "slabs":  # the kept columns in slabs of 50: dh summed over slabs in fp32
        tune(grad_filter, slab_bytes=1)
        tune(grad_filter, min_slab_cols=50)
    if mode == "capped":  # 3-row chunks; bf16: into the fp32 accumulator's halves that become grad_W
        tune(flce_mod, max_scratch_bytes=3 * 517 * dtype.itemsize)
    hidden, weight, bias, labels, hot = _filter_inputs(dtype, bias=case % 2 == 0)
    eps = _eps_in_the_gap(hidden, weight, bias, labels, hot, **FILTER_CASES[case])
    opts = dict(FILTER_CASES[case], grad_filter_eps=eps)
    _check(hidden, weight, bias, labels, **opts)
    hot_ids = hot.nonzero()[:, 0]
    assert any(torch.equal(cols, hot_ids) for cols in kept_columns)
    assert all(torch.equal(cols, hot_ids) or cols.numel() == 0 for cols in kept_columns)  # empty: a chunk of ignored rows
    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, w, labels, bias, **opts).sum().backward()
    assert (w.grad[~hot] == 0).all() and (w.grad[hot] != 0).any(1).all()


def test_grad_filter_dense_share(tune, monkeypatch, chunked_once):
    """Chunks with more kept columns than DENSE_SHARE run the dense GEMMs over all columns: exact gradients
    (dW then starts from zero rather than from the first chunk's GEMM)."""
    tune(grad_filter, dense_share=0.3)  # hot is ~40% of the columns
    monkeypatch.setattr(flce_mod, "sparse_gradients", lambda *a: pytest.fail("sparse path above DENSE_SHARE"))
    hidden, weight, bias, labels, hot = _filter_inputs(torch.float32, bias=True)
    eps = _eps_in_the_gap(hidden, weight, bias, labels, hot)
    tensors = [(t, True) for t in (hidden, weight, bias)]
    out, grads = _grads(fused_linear_cross_entropy, tensors, labels, _incoming({}, labels), grad_filter_eps=eps)
    t64 = [(t.double(), True) for t in (hidden, weight, bias)]
    out64, grads64 = _grads(fused_linear_cross_entropy_reference, t64, labels, _incoming({}, labels))
    for name, got, ref in zip(("dh", "dW", "db"), grads, grads64):
        assert_matches(got, ref, name=name)
    assert (grads[1][~hot] != 0).any()


@pytest.mark.parametrize("dense_first", [True, False])
def test_grad_filter_mixed_chunks(tune, monkeypatch, dense_first):
    """Dense and sparse chunks in one call, in either order (4-row chunks): the first chunk to write dW sets it
    (a dense GEMM with beta 0, or zeros then the kept rows), later ones add to it. Truth: the float64 dlogits with
    the cold columns dropped in the sparse chunks' rows only."""
    _chunk(tune, "budget_scratch")
    calls = []
    active = flce_mod.active_columns

    def alternate(d, *a):  # every other chunk reports all columns: above DENSE_SHARE, so it runs dense
        calls.append(None)
        dense = (len(calls) % 2 == 1) == dense_first
        return torch.arange(d.shape[1], device=d.device) if dense else active(d, *a)

    monkeypatch.setattr(flce_mod, "active_columns", alternate)
    hidden, weight, bias, labels, hot = _filter_inputs(torch.float32, bias=True)
    eps = _eps_in_the_gap(hidden, weight, bias, labels, hot)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    got = torch.autograd.grad(fused_linear_cross_entropy(*leaves[:2], labels, leaves[2], grad_filter_eps=eps), leaves)
    assert len(calls) == 4
    h64, w64, b64 = (t.double() for t in (hidden, weight, bias))
    z = (h64.reshape(-1, H) @ w64.t() + b64).requires_grad_()
    (d,) = torch.autograd.grad(flce_mod.cross_entropy_reference(z, labels.reshape(-1)), z)
    sparse_rows = (torch.arange(d.shape[0], device=DEVICE) // 4 % 2 == 1) == dense_first
    d = torch.where(sparse_rows[:, None] & ~hot[None, :], 0.0, d)
    want = ((d @ w64).reshape(hidden.shape), d.t() @ h64.reshape(-1, H), d.sum(0))
    for name, g, ref in zip(("dh", "dW", "db"), got, want):
        assert_matches(g, ref, name=name)


def test_grad_filter_module_default(tune, chunked_once):
    """GRAD_FILTER_EPS (what --loss-grad-filter-eps sets for a run) filters calls that pass no grad_filter_eps."""
    hidden, weight, bias, labels, hot = _filter_inputs(torch.float32, bias=False)
    tune(flce_mod, grad_filter_eps=_eps_in_the_gap(hidden, weight, None, labels, hot))
    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, w, labels).backward()
    assert (w.grad[~hot] == 0).all() and (w.grad[hot] != 0).any(1).all()


def test_grad_filter_everything_below_eps(chunked_once):
    """Every label ignored: no column is kept, so dh is zero (written, not left poisoned) and dW, db are zero."""
    hidden, weight, bias, labels, _ = _filter_inputs(torch.float32, bias=True)
    labels.fill_(IGNORE)
    tensors = [(t, True) for t in (hidden, weight, bias)]
    _, grads = _grads(fused_linear_cross_entropy, tensors, labels, _incoming({}, labels), grad_filter_eps=0.5)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_active_columns_rule():
    """|d| ≥ eps·|scale_row| and d ≠ 0, per row scale or one scale, across row splits and a partial column block."""
    active_columns = grad_filter.active_columns
    m, v = 70, 300
    d = torch.zeros(m, v, device=DEVICE)
    # Row scales of at least 0.6: column 150 (0.99·eps·scale, just below its own row's bar) then clears the one-scale
    # bar eps·0.5 below, on every draw (scales down to 0.5 left it under that bar in about one run in a hundred)
    scale = torch.rand(m, device=DEVICE) * 0.9 + 0.6
    d[5, 3], d[69, 299], d[40, 150] = 1e-3 * scale[5], -1e-3 * scale[69], 0.99e-3 * scale[40]
    d[:, 200] = 1e-9  # below eps in every row
    assert active_columns(d, scale, 1e-3).tolist() == [3, 299]
    assert active_columns(d, torch.tensor(0.5, device=DEVICE), 1e-3).tolist() == [3, 150, 299]
    assert active_columns(d, torch.zeros(m, device=DEVICE), 1e-3).tolist() == [3, 150, 200, 299]  # d ≠ 0 only
    padded = torch.zeros(m, v + 13, device=DEVICE)
    padded[:, :v] = d
    assert active_columns(padded[:, :v], scale, 1e-3).tolist() == [3, 299]  # strided rows


@pytest.mark.parametrize("eps", [0.0, 1.0, float("nan"), -1e-3])
def test_grad_filter_bad_eps(eps):
    hidden, weight, bias, labels = _inputs(67, torch.float32)
    with pytest.raises(ValueError, match="grad_filter_eps"):
        fused_linear_cross_entropy(hidden, weight, labels, grad_filter_eps=eps)


def test_grad_filter_bad_label_raises(chunked_once):
    """A bad label still raises the label error (the filter pass then reads logits the CE pass left alone)."""
    hidden, weight, bias, labels = _inputs(67, torch.float32, bias=True)
    labels[1, 2] = 67
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with pytest.raises(ValueError, match="67"):
        fused_linear_cross_entropy(*leaves[:2], labels, leaves[2], grad_filter_eps=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# The low-rank term (low_rank=(u, B): logits = h·Wᵀ + b + u·Bᵀ, a LoRA adapter on the head). u·Bᵀ is as large as
# h·Wᵀ (both ~N(0, 4) per logit), so an error in the term or in its gradients shows at the tolerances above.


def _low_rank(hidden, vocab, rank):
    """u with hidden's leading shape and B (V, r) in hidden's dtype."""
    u = torch.randn(*hidden.shape[:-1], rank, device=DEVICE).to(hidden.dtype)
    lw = (torch.randn(vocab, rank, device=DEVICE) * 2 / rank**0.5).to(hidden.dtype)
    return u, lw


def _class_weights(vocab):
    return torch.rand(vocab, device=DEVICE) + 0.5


# (vocabulary, rank, bias, options); "class_weights": True draws one weight per class
LOW_RANK_CASES = [
    (67, 1, False, dict()),
    (300, 3, True, dict(reduction="sum", loss_scale=0.3)),
    (517, 16, False, dict(reduction="none", loss_scale=2.0)),
    (517, 3, True, dict(label_smoothing=0.1, z_loss=1e-3, normalizer=40)),
    (300, 1, False, dict(softcap=2.0, loss_scale=0.5)),
    (67, 16, True, dict(label_smoothing=0.05, z_loss=1e-4, softcap=3.0, reduction="none")),
    (300, 3, False, dict(class_weights=True, z_loss=1e-3)),
    (517, 1, True, dict(class_weights=True, reduction="none", softcap=3.0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(LOW_RANK_CASES)))
def test_low_rank_matches_reference(tune, dtype, case):
    """Loss and the gradients of h, W, b, u and B against float64 over every scratch mode (several chunks, the
    overlapped schedule, one chunk in the accumulator's bytes), for each reduction and loss option."""
    _chunk(tune, SCRATCH_MODES[(case + (dtype == torch.bfloat16)) % len(SCRATCH_MODES)])
    vocab, rank, bias, opts = LOW_RANK_CASES[case]
    hidden, weight, b, labels = _inputs(vocab, dtype, bias=bias)
    if opts.get("class_weights"):
        opts = dict(opts, class_weights=_class_weights(vocab))
    _check(hidden, weight, b, labels, low_rank=_low_rank(hidden, vocab, rank), **opts)


@pytest.mark.parametrize("requires", [(True, False, False, True, True), (False, False, False, False, True),
                                      (False, True, True, True, False), (True, True, False, False, False)])
def test_low_rank_gradients_only_where_asked(chunked_once, monkeypatch, requires):
    """The LoRA case (frozen W and b, trained u and B) and other subsets: each gradient asked for matches, none other
    is computed, and neither a frozen W nor a frozen B reaches a dW / dB GEMM."""
    vocab, rank = 300, 3
    accumulated = []
    accumulate = flce_mod._accumulate_dw
    monkeypatch.setattr(flce_mod, "_accumulate_dw", lambda acc, *a, **k: (accumulated.append(tuple(acc.shape)),
                                                                          accumulate(acc, *a, **k)))
    hidden, weight, bias, labels = _inputs(vocab, torch.float32, bias=True)
    _check(hidden, weight, bias, labels, requires=requires, low_rank=_low_rank(hidden, vocab, rank),
           label_smoothing=0.1)
    assert ((vocab, H) in accumulated) == requires[1]
    assert ((vocab, rank) in accumulated) == requires[4]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_rank_strided_inputs(chunked_once, reduction):
    """u as a slice of a wider tensor (row-strided: used in place), u as a transposed view (copied), and hidden as a
    transposed view, against the float64 gradients of the tensors they are views of."""
    vocab, rank = 300, 3
    hidden, weight, bias, labels = _inputs(vocab, torch.float32, bias=True)
    _, lw = _low_rank(hidden, vocab, rank)
    wide = torch.randn(B, T, rank + 5, device=DEVICE)
    _check(hidden, weight, bias, labels, low_rank=(wide, lw), u_view=lambda w: w[..., 2 : 2 + rank],
           reduction=reduction)
    swapped = torch.randn(T, B, rank, device=DEVICE)
    _check(hidden.transpose(0, 1).contiguous().transpose(0, 1), weight, bias, labels, low_rank=(swapped, lw),
           u_view=lambda s: s.transpose(0, 1), reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_low_rank_target_rank_and_extras(chunked_once, dtype, reduction):
    """Ranks, the z-loss term and the token accuracy are those of the logits with the low-rank term."""
    vocab, rank = 517, 3
    hidden, weight, _, labels = _inputs(vocab, dtype)
    u, lw = _low_rank(hidden, vocab, rank)
    opts = dict(reduction=reduction, z_loss=1e-3, return_target_rank=True, return_z_loss=True,
                return_token_accuracy=True)
    out, out64 = _check(hidden, weight, None, labels, low_rank=(u, lw), **opts)
    logits = (hidden @ weight.t() + u @ lw.t()).float()  # what the kernel ranks: in the input dtype
    valid = labels != IGNORE
    target = logits.gather(-1, labels.clamp(min=0)[..., None])
    margin = 1e-5 if dtype == torch.float32 else 3e-2  # near-ties only may move a rank (see test_target_rank)
    lo = (logits > target + margin * target.abs().clamp(min=1)).sum(-1)
    hi = (logits > target - margin * target.abs().clamp(min=1)).sum(-1)
    rank_ = out.target_rank
    assert torch.equal(rank_[~valid], torch.full_like(rank_[~valid], -1))
    assert ((rank_[valid] >= lo[valid]) & (rank_[valid] <= hi[valid])).all()
    top1 = (rank_[valid] == 0).float().mean()
    assert torch.equal(out.token_accuracy, top1)
    if dtype == torch.float32:
        assert_matches(out.z_loss, out64.z_loss, name="z")


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_low_rank_under_a_scratch_cap(tune, monkeypatch, accum_dtype):
    """bf16 under a 3-row scratch cap (< H): with fp32 accumulation dW accumulates in the halves that become grad_W,
    with bf16 accumulation in grad_W itself; dB sums in fp32 either way."""
    _chunk(tune, "budget_scratch")
    vocab, rank = 301, 16
    tune(flce_mod, max_scratch_bytes=3 * vocab * 2)
    accumulators = {}
    accumulate = flce_mod._accumulate_dw
    monkeypatch.setattr(flce_mod, "_accumulate_dw", lambda acc, *a, **k: (
        accumulators.setdefault(acc.shape[1], set()).add(acc.dtype), accumulate(acc, *a, **k)))
    hidden, weight, bias, labels = _inputs(vocab, torch.bfloat16, bias=True)
    _check(hidden, weight, bias, labels, low_rank=_low_rank(hidden, vocab, rank), accum_dtype=accum_dtype,
           z_loss=1e-3)
    assert accumulators == {H: {accum_dtype}, rank: {torch.float32}}


def test_low_rank_with_a_weight_gradient_consumer(chunked_once):
    """consume_weight_grad takes dW in the forward; u's and B's gradients arrive through backward as usual."""
    vocab, rank = 300, 3
    hidden, weight, _, labels = _inputs(vocab, torch.float32)
    u, lw = _low_rank(hidden, vocab, rank)
    w, u_, lw_ = (t.clone().requires_grad_() for t in (weight, u, lw))
    handed = []
    forget = consume_weight_grad(w, lambda grad, node: handed.append(grad))
    try:
        fused_linear_cross_entropy(hidden, w, labels, low_rank=(u_, lw_)).backward()
    finally:
        forget()
    w64, u64, lw64 = (t.double().requires_grad_() for t in (weight, u, lw))
    fused_linear_cross_entropy_reference(hidden.double(), w64, labels, low_rank=(u64, lw64)).backward()
    assert w.grad is None and handed[-1] is None
    assert_matches(handed[0], w64.grad, name="dW")
    assert_matches(u_.grad, u64.grad, name="du")
    assert_matches(lw_.grad, lw64.grad, name="dB")


@pytest.mark.parametrize("mode,opts", [("grad_w_scratch", dict()), ("slabs", dict(reduction="none", z_loss=1e-3)),
                                       ("capped", dict(reduction="sum", loss_scale=0.5))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_rank_with_the_gradient_filter(tune, kept_columns, mode, opts, dtype):
    """grad_filter_eps with a (small) low-rank term: the kept columns are those of the full logits, their du and dB
    contributions exact, the cold columns' rows of dB exactly zero; against the reference with the same filter.
    slabs: the kept columns in slabs of 50, dh and du summed over slabs in fp32."""
    _chunk(tune, "budget_scratch" if mode == "capped" else "grad_w_scratch")
    if mode == "slabs":
        tune(grad_filter, slab_bytes=1)
        tune(grad_filter, min_slab_cols=50)
    if mode == "capped":
        tune(flce_mod, max_scratch_bytes=3 * 517 * dtype.itemsize)
    hidden, weight, bias, labels, hot = _filter_inputs(dtype, bias=True)
    u, lw = _low_rank(hidden, 517, 3)
    lw = (lw.float() / 20).to(dtype)  # ~0.1 per logit: the hot / cold gap stays
    eps = _eps_in_the_gap(hidden, weight, bias, labels, hot, low_rank=(u, lw), **opts)
    _check(hidden, weight, bias, labels, low_rank=(u, lw), grad_filter_eps=eps, **opts)
    hot_ids = hot.nonzero()[:, 0]
    assert any(torch.equal(cols, hot_ids) for cols in kept_columns)
    assert all(torch.equal(cols, hot_ids) or cols.numel() == 0 for cols in kept_columns)
    lw_ = lw.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, weight, labels, bias, low_rank=(u, lw_), grad_filter_eps=eps,
                               **opts).sum().backward()
    assert (lw_.grad[~hot] == 0).all() and (lw_.grad[hot] != 0).any(1).all()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_rank_all_ignored_and_no_kept_column(chunked_once, reduction):
    """Every label ignored: du and dB are exactly zero, with the gradient filter too (no column kept: du is written
    as zeros, not left poisoned)."""
    vocab = 67
    hidden, weight, bias, labels = _inputs(vocab, torch.bfloat16, bias=True)
    labels.fill_(IGNORE)
    u, lw = _low_rank(hidden, vocab, 3)
    for eps in (None, 0.5):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias, u, lw)]
        loss = fused_linear_cross_entropy(*leaves[:2], labels, leaves[2], low_rank=tuple(leaves[3:]),
                                          reduction=reduction, z_loss=1e-2, grad_filter_eps=eps)
        loss.sum().backward()
        assert torch.equal(loss, torch.zeros_like(loss))
        for t in leaves:
            assert torch.equal(t.grad, torch.zeros_like(t)), "grads must be exactly zero"


def test_low_rank_reference_mode():
    """With the kernels off (reference_mode) the call computes the reference's loss and gradients."""
    from liger_models import reference_mode

    vocab = 300
    hidden, weight, bias, labels = _inputs(vocab, torch.float32, bias=True)
    tensors = [(t, True) for t in (hidden, weight, bias, *_low_rank(hidden, vocab, 3))]
    with reference_mode():
        out, grads = _grads(fused_linear_cross_entropy, tensors, labels, _incoming({}, labels), z_loss=1e-3)
    t64 = [(t.double(), True) for t, _ in tensors]
    out64, grads64 = _grads(fused_linear_cross_entropy_reference, t64, labels, _incoming({}, labels), z_loss=1e-3)
    assert_matches(out, out64, name="loss")
    for name, got, ref in zip(("dh", "dW", "db", "du", "dB"), grads, grads64):
        assert_matches(got, ref, name=name)


def test_low_rank_bad_arguments():
    vocab = 67
    hidden, weight, _, labels = _inputs(vocab, torch.float32)
    u, lw = _low_rank(hidden, vocab, 3)
    for low_rank, match in [
        (u, "low_rank must be a pair"),
        ((u, lw, lw), "low_rank must be a pair"),
        ((u, None), "pair of tensors"),
        ((u[:, :-1], lw), r"u must be \(\.\.\., r\) with hidden's leading shape \(2, 7\)"),
        ((u[0], lw), "u must be"),
        ((u[..., :0], lw[:, :0]), "r >= 1"),
        ((u, lw[:-1]), r"B must be \(V, r\) = \(67, 3\), got \(66, 3\)"),
        ((u, lw[:, :2]), r"B must be \(V, r\) = \(67, 3\)"),
        ((u.double(), lw.double()), "share one floating dtype"),
        ((u, lw.to(torch.bfloat16)), "share one floating dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            fused_linear_cross_entropy(hidden, weight, labels, low_rank=low_rank)



# ---------------------------------------------------------------------------------------------------------------
# use_token_scaling (each token's loss and gradient times its detached target probability p_t: TRL's DFT loss) and
# return_predicted_tokens (each token's argmax, taken from a chunk's logits before the gradient overwrites them).

# (vocabulary, bias, options); "class_weights": True draws one weight per class
TOKEN_SCALING_CASES = [
    (67, False, dict()),
    (300, True, dict(reduction="sum", loss_scale=0.3, label_smoothing=0.1)),
    (517, False, dict(reduction="none", loss_scale=2.0, z_loss=1e-3)),
    (300, True, dict(softcap=2.0, z_loss=1e-3, normalizer=40)),
    (517, True, dict(class_weights=True, reduction="none", softcap=3.0)),
    (67, False, dict(class_weights=True, reduction="sum", z_loss=1e-3)),
    (300, False, dict(label_smoothing=0.05, z_loss=1e-4, softcap=3.0, reduction="none")),
]


def _scaled_logits_size(t, dtype):
    """bf16: t / 4, so that the logits are ~N(0, 1/4) instead of ~N(0, 4). A token-scaled row's gradient is p_t·dℓ_t,
    and p_t = exp(z_t − lse) takes the absolute bf16 rounding of the logits (up to |z|·2⁻⁹) as its relative error;
    the rows of largest p_t, whose target logits are largest, dominate the gradients, so their bf16 error is about
    2⁻⁹·max z_t: above 1e-2, the protocol's bound, for eager PyTorch itself at the other tests' logits (up to ±8),
    ~5e-3 at these. fp32: t unchanged."""
    return (t.float() / 4).to(dtype) if dtype == torch.bfloat16 and t is not None else t


def _token_scaling_case(case, dtype):
    vocab, bias, opts = TOKEN_SCALING_CASES[case]
    hidden, weight, b, labels = _inputs(vocab, dtype, bias=bias)
    if opts.get("class_weights"):
        opts = dict(opts, class_weights=_class_weights(vocab))
    weight, b = _scaled_logits_size(weight, dtype), _scaled_logits_size(b, dtype)
    return hidden, weight, b, labels, dict(opts, use_token_scaling=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(TOKEN_SCALING_CASES)))
def test_token_scaling_matches_reference(tune, dtype, case):
    """Loss and the gradients of h, W and b against float64 over every scratch mode, for each reduction and loss
    option (p_t is the probability of the softcapped logits; smoothing's, z-loss's and the class weight's terms are
    scaled with the rest)."""
    _chunk(tune, SCRATCH_MODES[(case + (dtype == torch.bfloat16)) % len(SCRATCH_MODES)])
    hidden, weight, b, labels, opts = _token_scaling_case(case, dtype)
    _check(hidden, weight, b, labels, **opts)


def test_token_scaling_reference_is_the_scaled_per_token_loss():
    """The reference itself: the per-token reference loss times softmax(capped logits)[target], detached, reduced
    as without scaling (the mean over the non-ignored count, or the normaliser)."""
    hidden, weight, bias, labels = _inputs(300, torch.float64, bias=True)
    opts = dict(softcap=3.0, z_loss=1e-3, label_smoothing=0.1)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    per_token = flce_mod.cross_entropy_reference(logits, labels, reduction="none", **opts)
    capped = 3.0 * torch.tanh(logits / 3.0)
    p = capped.softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    scaled = per_token * torch.where(labels != IGNORE, p, 0.0)
    for reduction, normalizer, want in (("none", None, scaled), ("sum", None, scaled.sum()),
                                        ("mean", None, scaled.sum() / (labels != IGNORE).sum()),
                                        ("mean", 40, scaled.sum() / 40)):
        got = fused_linear_cross_entropy_reference(hidden, weight, labels, bias, reduction=reduction,
                                                   normalizer=normalizer, use_token_scaling=True, **opts)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [0, 2, 4])
def test_token_scaling_with_low_rank(tune, dtype, case):
    """The low-rank term's gradients du and dB carry p_t as dh and dW do."""
    _chunk(tune, SCRATCH_MODES[(case + 1 + (dtype == torch.bfloat16)) % len(SCRATCH_MODES)])
    hidden, weight, b, labels, opts = _token_scaling_case(case, dtype)
    u, lw = _low_rank(hidden, weight.shape[0], 3)
    _check(hidden, weight, b, labels, low_rank=(u, _scaled_logits_size(lw, dtype)), **opts)


@pytest.mark.parametrize("mode,opts", [("grad_w_scratch", dict()), ("slabs", dict(reduction="none", z_loss=1e-3)),
                                       ("capped", dict(reduction="sum", softcap=30.0))])
def test_token_scaling_with_the_gradient_filter(tune, kept_columns, mode, opts):
    """The filter's rule is on each token's unscaled loss gradient (p_t, as class weights and the mean's
    denominator, is a row factor outside it): the same hot columns are kept, and the kept ones are exact."""
    _chunk(tune, "budget_scratch" if mode == "capped" else "grad_w_scratch")
    if mode == "slabs":
        tune(grad_filter, slab_bytes=1)
        tune(grad_filter, min_slab_cols=50)
    if mode == "capped":
        tune(flce_mod, max_scratch_bytes=3 * 517 * 4)
    hidden, weight, bias, labels, hot = _filter_inputs(torch.float32, bias=True)
    eps = _eps_in_the_gap(hidden, weight, bias, labels, hot, **opts)
    _check(hidden, weight, bias, labels, grad_filter_eps=eps, use_token_scaling=True, **opts)
    hot_ids = hot.nonzero()[:, 0]
    assert any(torch.equal(cols, hot_ids) for cols in kept_columns)
    assert all(torch.equal(cols, hot_ids) or cols.numel() == 0 for cols in kept_columns)


def test_token_scaling_with_a_weight_gradient_consumer(chunked_once):
    """consume_weight_grad gets the token-scaled dW in the forward."""
    hidden, weight, _, labels = _inputs(300, torch.float32)
    w = weight.clone().requires_grad_()
    handed = []
    forget = consume_weight_grad(w, lambda grad, node: handed.append(grad))
    try:
        fused_linear_cross_entropy(hidden, w, labels, use_token_scaling=True, z_loss=1e-3).backward()
    finally:
        forget()
    w64 = weight.double().requires_grad_()
    fused_linear_cross_entropy_reference(hidden.double(), w64, labels, use_token_scaling=True, z_loss=1e-3).backward()
    assert w.grad is None and handed[-1] is None
    assert_matches(handed[0], w64.grad, name="dW")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_scaling_all_ignored(chunked_once, reduction):
    """Every label ignored: p_t is 0 everywhere, the loss and every gradient exactly zero (no NaN from the rows'
    statistics)."""
    hidden, weight, bias, labels = _inputs(67, torch.bfloat16, bias=True)
    labels.fill_(IGNORE)
    leaves = [t.detach().requires_grad_() for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], labels, leaves[2], reduction=reduction, z_loss=1e-2,
                                      use_token_scaling=True)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    for t in leaves:
        assert torch.equal(t.grad, torch.zeros_like(t)), "grads must be exactly zero"


def test_token_scaling_strided_inputs_and_module(chunked_once):
    """A transposed-view hidden and strided labels; the module passes the option on."""
    hidden, weight, bias, labels = _inputs(300, torch.float32, bias=True)
    swapped = hidden.transpose(0, 1).contiguous().transpose(0, 1)
    strided_labels = torch.stack((labels, labels), -1)[..., 1]
    assert not swapped.is_contiguous() and not strided_labels.is_contiguous()
    _check(swapped, weight, bias, strided_labels, reduction="none", use_token_scaling=True)
    module = FusedLinearCrossEntropyLoss(reduction="sum", z_loss=1e-3, use_token_scaling=True)
    want = fused_linear_cross_entropy_reference(hidden.double(), weight.double(), labels, bias.double(),
                                                reduction="sum", z_loss=1e-3, use_token_scaling=True)
    assert_matches(module(hidden, weight, labels, bias), want, name="module loss")


def _assert_predictions(predicted, logits64, labels, dtype, softcap=None):
    """predicted (labels' shape, int64) is the float64 argmax of the (capped) logits wherever its top two are
    further apart than rounding the logits to dtype can move them (twice the half-ulp of the largest, bf16; fp32:
    the fp32 tolerance of docs/kernels.md) and, capped, than fp32 rounding of the cap; -1 where the label is
    ignored."""
    assert predicted.dtype == torch.int64 and predicted.shape == labels.shape
    valid = labels != IGNORE
    assert torch.equal(predicted[~valid], torch.full_like(predicted[~valid], -1))
    top2 = logits64.topk(2, -1).values
    rounding = (2**-8 if dtype == torch.bfloat16 else 1e-5) * logits64.abs().amax(-1)
    clear = valid & (top2[..., 0] - top2[..., 1] > 2 * rounding)
    x = logits64
    if softcap is not None:
        x = softcap * torch.tanh(logits64 / softcap)
        capped2 = softcap * torch.tanh(top2 / softcap)
        clear &= capped2[..., 0] - capped2[..., 1] > softcap * 2**-20
    assert clear.sum() >= 0.5 * valid.sum(), "the test's logits lost their gaps"
    assert torch.equal(predicted[clear], x.argmax(-1)[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,opts", [
    ("grad_w_scratch", dict()),
    ("budget_scratch+overlap", dict(reduction="none", softcap=3.0, return_target_rank=True)),
    ("single_chunk", dict(reduction="sum", use_token_scaling=True, return_z_loss=True, z_loss=1e-3)),
    ("budget_scratch", dict(z_loss=1e-3, return_token_accuracy=True, class_weights=True)),
])
def test_predicted_tokens(tune, dtype, mode, opts):
    """Over several chunks (or one), with the other extras and options: the predictions are the argmax of the
    logits, -1 where ignored; loss and gradients match the reference as without them."""
    _chunk(tune, mode)
    vocab = 517
    hidden, weight, bias, labels = _inputs(vocab, dtype, bias=True)
    if opts.get("class_weights"):
        opts = dict(opts, class_weights=_class_weights(vocab))
    if opts.get("use_token_scaling"):
        weight, bias = _scaled_logits_size(weight, dtype), _scaled_logits_size(bias, dtype)
    out, out64 = _check(hidden, weight, bias, labels, return_predicted_tokens=True, **opts)
    assert isinstance(out, LossOutput)
    assert (out.target_rank is not None) == bool(opts.get("return_target_rank"))
    logits64 = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double())
    _assert_predictions(out.predicted_tokens, logits64, labels, dtype, opts.get("softcap"))
    _assert_predictions(out64.predicted_tokens, logits64, labels, torch.float32, opts.get("softcap"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_predicted_tokens_break_ties_like_argmax(chunked_once, reduction):
    """Tied maxima predict the lowest index: a zero hidden state (every logit 0) predicts 0, and twin columns (equal
    rows of W and of B) that hold the maximum of batch row 0's tokens (a constant feature of weight 50 in both)
    predict the first twin; the low-rank term enters the logits that are compared."""
    vocab = 517
    hidden, weight, _, labels = _inputs(vocab, torch.float32)
    hidden[1] = 0.0
    hidden[0, :, 0] = 1.0
    first, second = torch.randperm(vocab, device=DEVICE)[:2].sort().values.tolist()
    weight[:, 0] = 0.0
    weight[first, 0] = 50.0
    weight[second] = weight[first]
    u, lw = _low_rank(hidden, vocab, 2)
    u[1] = 0.0
    lw[second] = lw[first]
    hidden.requires_grad_()
    out = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, low_rank=(u, lw),
                                     return_predicted_tokens=True)
    valid = labels != IGNORE
    assert torch.equal(out.predicted_tokens[1][valid[1]], torch.zeros_like(labels[1][valid[1]]))
    assert torch.equal(out.predicted_tokens[0][valid[0]], torch.full_like(labels[0][valid[0]], first))


def test_predicted_tokens_without_gradients(chunked_once):
    """Under no_grad (evaluation: no gradient pass at all) the predictions are those of the training call."""
    hidden, weight, bias, labels = _inputs(300, torch.bfloat16, bias=True)
    with torch.no_grad():
        out = fused_linear_cross_entropy(hidden, weight, labels, bias, return_predicted_tokens=True)
    h = hidden.clone().requires_grad_()
    trained = fused_linear_cross_entropy(h, weight, labels, bias, return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, trained.predicted_tokens)
    torch.testing.assert_close(out.loss, trained.loss.detach(), rtol=1e-6, atol=0)


# GPU: real sizes (the lead runs `pytest -m gpu` on the H200)


def _gpu_case(n, hdim, vocab, **opts):
    torch.manual_seed(0)
    hidden = (torch.randn(n, hdim, device="cuda") / 2).to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5 * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::11] = IGNORE
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, **opts)
    loss.backward()
    hf, wf = hidden.float().requires_grad_(), weight.float().requires_grad_()  # fp32 math on the bf16 values
    ref = fused_linear_cross_entropy_reference(hf, wf, labels, **opts)
    ref.backward()
    he, we = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_linear_cross_entropy_reference(he, we, labels, **opts).backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=2e-3, atol=0)  # bf16 logits vs fp32 logits
    assert_matches(h.grad, hf.grad.double(), eager=he.grad, name="dh")
    assert_matches(w.grad, wf.grad.double(), eager=we.grad, name="dW")


def _gpu_runs(hidden, weight, labels, **opts):
    """Ours in bf16, the reference in fp32 and eager PyTorch in bf16, each on fresh leaves holding the same bf16
    values and backpropagated with one incoming gradient (per token for reduction="none"): [(output, dh, dW)]."""
    n = labels.numel()
    g = torch.randn(n, device="cuda") if opts.get("reduction") == "none" else torch.tensor(1.0, device="cuda")
    runs = []
    for fn, dtype in ((fused_linear_cross_entropy, torch.bfloat16), (fused_linear_cross_entropy_reference,
                                                                     torch.float32),
                      (fused_linear_cross_entropy_reference, torch.bfloat16)):
        h, w = (t.to(dtype, copy=True).requires_grad_() for t in (hidden, weight))
        out = fn(h, w, labels, **opts)
        (out[0] if isinstance(out, tuple) else out).backward(g)
        runs.append((out, h.grad, w.grad))
    return runs


@pytest.mark.gpu
def test_gpu_fp32_output_gemm_available():
    """The fast dW path (cuBLAS with an fp32 C, torch ≥ 2.8) must be the one in use on the H200."""
    assert flce_mod._fp32_out_gemm(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "overlap", "single", "capped"])
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0, loss_scale=0.5),
                                  dict(reduction="sum")])
def test_gpu_real_size(tune, opts, mode):
    """2 chunks of 2048 rows in grad_W's storage; overlap: 4 chunks of 1024, CE on a side stream; single: the
    4096 rows (= 2H) as one chunk, dW one GEMM straight into grad_W; capped: a 768-row scratch, 6 chunks into an
    fp32 accumulator that becomes grad_W in place."""
    tune(flce_mod, overlap_ce=mode == "overlap")
    tune(flce_mod, max_scratch_bytes=768 * 128256 * 2 if mode == "capped" else None)
    tune(flce_mod, single_chunk_in_accumulator=mode == "single")
    _gpu_case(4096, 2048, 128256, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [False, True])
def test_gpu_overlapped_schedule_under_load(tune, frozen):
    """Many chunks with the CE pass on the side stream (frozen W: 8 MiB budget halves; else 16 chunks of 256
    rows in grad_W's storage), reduction="none" (its backward reruns the chunk loop)."""
    tune(flce_mod, overlap_ce=True)
    tune(flce_mod, logits_budget_bytes=8 << 20)
    torch.manual_seed(0)
    n, hdim, vocab = 4096, 512, 32000
    hidden = torch.randn(n, hdim, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5 * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = IGNORE
    g = torch.randn(n, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
    loss = fused_linear_cross_entropy(h, w, labels, reduction="none")
    loss.backward(g)
    hf, wf = hidden.float().requires_grad_(), weight.float().requires_grad_(not frozen)
    ref = fused_linear_cross_entropy_reference(hf, wf, labels, reduction="none")
    ref.backward(g)
    he, we = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
    eager = fused_linear_cross_entropy_reference(he, we, labels, reduction="none")
    eager.backward(g)
    _assert_loss_of_bf16_logits(loss, ref.detach().double(), eager.detach())
    assert_matches(h.grad, hf.grad.double(), eager=he.grad, name="dh")
    if frozen:
        assert w.grad is None
    else:
        assert_matches(w.grad, wf.grad.double(), eager=we.grad, name="dW")


@pytest.mark.gpu
@BIG_MEMORY  # the float64 gap check holds 6144 × 128256 logits and their gradient
@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", z_loss=1e-4, softcap=30.0, loss_scale=0.5)])
def test_gpu_grad_filter_real_size(kept_columns, opts):
    """6144 tokens × 128256 columns, 2% hot (the test data of test_grad_filter_skips_cold_columns at size): three
    2048-row chunks (N > 2H: in grad_W's storage) through the gathered GEMMs, against the fp32 and eager references
    with the same filter."""
    torch.manual_seed(0)
    n, hdim, vocab = 6144, 2048, 128256
    hidden = (torch.randn(n, hdim, device="cuda") / 2).to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5).to(torch.bfloat16)
    labels = torch.zeros(n, dtype=torch.long, device="cuda")
    labels[::11] = IGNORE
    labels, hot = _hot_and_cold(hidden, weight, labels, 0.02)
    hot_ids = hot.nonzero()[:, 0]
    eps = _eps_in_the_gap(hidden.float(), weight.float(), None, labels, hot, **opts)
    runs = _gpu_runs(hidden, weight, labels, grad_filter_eps=eps, **opts)
    (_, dh, dw), (_, dh32, dw32), (_, dh_eager, dw_eager) = runs
    assert len(kept_columns) == 3 and all(torch.equal(cols, hot_ids) for cols in kept_columns)
    assert_matches(dh, dh32.double(), eager=dh_eager, name="dh")
    assert_matches(dw, dw32.double(), eager=dw_eager, name="dW")
    assert (dw[~hot] == 0).all()


def _gpu_schedule(tune, mode, vocab, opts):
    """A real-size schedule: "overlap" runs the CE passes on the side stream, "capped" caps the scratch at 768 rows,
    "filtered" adds the gradient filter at 1e-30 (every column kept: exact) with the gathered GEMMs forced for all
    of them. Returns opts, with the filter's eps when filtered."""
    tune(flce_mod, overlap_ce=mode == "overlap")
    tune(flce_mod, max_scratch_bytes=768 * vocab * 2 if mode == "capped" else None)
    if mode != "filtered":
        return opts
    tune(grad_filter, dense_share=1.0)
    return dict(opts, grad_filter_eps=1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "overlap", "capped", "filtered"])
@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                               loss_scale=0.5)])
def test_gpu_low_rank_real_size(tune, kept_columns, mode, opts):
    """A LoRA adapter on a frozen head at size: 4096 tokens, H 2048, V 32003 (no multiple of any block), r 16, bf16,
    u = s·A·h formed outside the op (as the causal-LM loss does), so dh also carries (du·s)·A. The logits of the
    base and of the adapter are of one size (~N(0, 4) and ~N(0, 1)). Loss, dh, dA and dB against float64, with
    eager bf16 PyTorch's error as the bar. A 1024-row logits budget (frozen W: no grad_W storage) makes 4 chunks;
    overlap: 8 of 512 rows, the CE pass on the side stream; capped: a 768-row scratch cap, 6 chunks; filtered: the
    gradient filter at 1e-30 (every column kept: exact) with the gathered GEMMs forced for all of them."""
    tune(flce_mod, logits_budget_bytes=1024 * 32003 * 2)
    opts = _gpu_schedule(tune, mode, 32003, opts)
    torch.manual_seed(0)
    n, hdim, vocab, rank, scaling = 4096, 2048, 32003, 16, 2.0
    hidden = (torch.randn(n, hdim, device="cuda") / 2).to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5 * 4).to(torch.bfloat16)
    lora_a = (torch.randn(rank, hdim, device="cuda") / hdim**0.5).to(torch.bfloat16)
    lora_b = (torch.randn(vocab, rank, device="cuda") / rank**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::11] = IGNORE
    g = torch.randn(n, device="cuda") if opts.get("reduction") == "none" else torch.tensor(1.0, device="cuda")
    runs = []
    for fn, dtype in ((fused_linear_cross_entropy, torch.bfloat16), (fused_linear_cross_entropy_reference,
                                                                     torch.float64),
                      (fused_linear_cross_entropy_reference, torch.bfloat16)):
        h, a, b = (t.to(dtype, copy=True).requires_grad_() for t in (hidden, lora_a, lora_b))
        u = torch.nn.functional.linear(h, a * scaling)
        loss = fn(h, weight.to(dtype), labels, low_rank=(u, b), **opts)
        loss.backward(g.to(loss.dtype))
        runs.append((loss.detach(), h.grad, a.grad, b.grad))
    ours, exact, eager = runs
    if mode == "filtered":
        assert len(kept_columns) == 4 and all(cols.numel() == vocab for cols in kept_columns)
    _assert_loss_of_bf16_logits(ours[0], exact[0], eager[0])
    for name, got, ref, eager_grad in zip(("dh", "dA", "dB"), ours[1:], exact[1:], eager[1:]):
        assert got.dtype == torch.bfloat16, name
        assert_matches(got, ref, eager=eager_grad, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "overlap", "capped", "filtered"])
@pytest.mark.parametrize("opts", [dict(), dict(reduction="none", label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                               loss_scale=0.5),
                                  dict(reduction="sum", class_weights=True, z_loss=1e-4)])
def test_gpu_token_scaling_and_predictions_real_size(tune, kept_columns, mode, opts):
    """use_token_scaling with return_predicted_tokens at size: 4096 tokens, H 2048, V 128256, bf16; default: 2
    chunks of 2048 rows in grad_W's storage; overlap: 4 of 1024, the two CE launches and p_t on the side stream;
    capped: a 768-row scratch cap, 6 chunks into the fp32 accumulator that becomes grad_W; filtered: the gradient
    filter at 1e-30 (every column kept: exact) through the gathered GEMMs, reading the row scales p_t·scale. Loss, dh
    and dW against the fp32 reference on the same bf16 values, with eager bf16 PyTorch's error as the bar; logits
    ~N(0, 1/4) (_scaled_logits_size says why). The predictions are the argmax of the fp32 logits wherever bf16
    rounding cannot reorder the top two."""
    tune(flce_mod, single_chunk_in_accumulator=False)  # N = 2H would be one chunk
    opts = _gpu_schedule(tune, mode, 128256, opts)
    torch.manual_seed(0)
    n, hdim, vocab = 4096, 2048, 128256
    hidden = (torch.randn(n, hdim, device="cuda") / 2).to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::11] = IGNORE
    if opts.get("class_weights"):
        opts = dict(opts, class_weights=torch.rand(vocab, device="cuda") + 0.5)
    ours, exact, eager = _gpu_runs(hidden, weight, labels, use_token_scaling=True, return_predicted_tokens=True,
                                   **opts)
    if mode == "filtered":
        assert len(kept_columns) == 2 and all(cols.numel() == vocab for cols in kept_columns)
    _assert_loss_of_bf16_logits(ours[0].loss.detach(), exact[0].loss.detach().double(), eager[0].loss.detach())
    for name, got, ref, eager_grad in zip(("dh", "dW"), ours[1:], exact[1:], eager[1:]):
        assert_matches(got, ref.double(), eager=eager_grad, name=name)
    logits = hidden.float() @ weight.float().t()
    _assert_predictions(ours[0].predicted_tokens, logits, labels, torch.bfloat16, opts.get("softcap"))


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_n_times_v_above_2_31():
    """8500 tokens × 256000 vocab = 2.18e9 logits (never materialised by the op)."""
    assert 8500 * 256000 > 2**31
    _gpu_case(8500, 1024, 256000)
