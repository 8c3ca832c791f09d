"""cross_entropy against a float64 reference (docs/kernels.md#correctness-protocol), on CPU through Triton's
interpreter.

Every tensor the op allocates is NaN-poisoned, so an element the kernel forgets to write fails. Vocab sizes are
not multiples of the block; labels include 0, V−1 and ignored rows. ``-m gpu`` adds the real sizes, including a
logits tensor above 2³¹ elements.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from liger_models.kernels.ops import _ce_core, _ce_meet, _loss_common
from liger_models.kernels.ops import _labels as label_check
from liger_models.kernels.ops.cross_entropy import CrossEntropyLoss, cross_entropy, cross_entropy_reference
from tests.helpers import BIG_MEMORY, DEVICE, assert_matches, poison_

IGNORE = -100
# (options, reduction); every option alone, then all together with an external normaliser.
CASES = [
    (dict(), "mean"),
    (dict(), "sum"),
    (dict(), "none"),
    (dict(label_smoothing=0.1), "mean"),
    (dict(z_loss=1e-3), "sum"),
    (dict(softcap=4.0), "mean"),
    (dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0, normalizer=37), "mean"),
    (dict(label_smoothing=0.05, softcap=2.5, z_loss=1e-4), "none"),
]


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def _labels(n, vocab, device=DEVICE):
    y = torch.randint(0, vocab, (n,), device=device)
    y[0], y[-1] = 0, vocab - 1
    y[n // 2] = IGNORE
    return y


def _check(logits, labels, reduction="mean", grad_scale=None, **opts):
    """Loss and dlogits of cross_entropy vs float64 and vs eager in the logits' dtype."""
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, labels, reduction=reduction, **opts)
    if grad_scale is None:  # per-row grads for "none"; a power of two for mean / sum (exact rescaling in bf16)
        grad_scale = torch.randn_like(loss) if reduction == "none" else torch.tensor(-0.5)
    g = torch.as_tensor(grad_scale, dtype=loss.dtype, device=loss.device).expand_as(loss)
    (dx,) = torch.autograd.grad(loss, x, g)
    x64 = logits.detach().double().requires_grad_()
    loss64 = cross_entropy_reference(x64, labels, reduction=reduction, **opts)
    (dx64,) = torch.autograd.grad(loss64, x64, g.double())
    xe = logits.detach().clone().requires_grad_()
    (dxe,) = torch.autograd.grad(cross_entropy_reference(xe, labels, reduction=reduction, **opts), xe, g)
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    assert dx.dtype == logits.dtype and dx.shape == logits.shape
    # The loss is lse − x_t (and the option terms) formed from O(1) logits: its fp32 error is absolute, so a loss
    # near 0 (a confident prediction) is checked at scale 1; the gradient at its own scale (1/N for the mean).
    assert_matches(loss, loss64, name="loss", scale_floor=1.0)
    assert_matches(dx, dx64, eager=dxe, name="dlogits")
    return loss, dx


# Kernel settings: the default; 128-column blocks (rows of 300 / 517: 2 / 4 whole blocks and a partial one, so the
# target falls in a whole block or in the masked tail), per-block sums in pass 1; the same with per-thread partial
# sums (the default from 4096 rows on) and a register cap; the same with pass 2 in forward order, no eviction hints
# and per-block sums; 64-column blocks with pass 1's loads split into an evict_first head and a 64-column evict_last
# tail; rows split over programs (32-column blocks; rows of 300 / 517 over 2 / 4 programs of 5 / 4 whole blocks, the
# last one short and with the partial block), with per-block and with lane sums and an evict_first head.
SETTINGS = {"default": {}, "128-col-blocks": dict(block_v=128, lane_sums=False, keep_l2_share=0.0),
            "128-col-blocks-lanes": dict(block_v=128, lane_sums=True, lane_sums_min_rows=0,
                                         max_registers=32),
            "128-col-blocks-forward": dict(block_v=128, reverse_pass2=False, eviction_hints=False,
                                           lane_sums=False),
            "64-col-blocks-keep-tail": dict(block_v=64, lane_sums=False, keep_l2_share=3e-5),
            "split-rows": dict(block_v=32, split_min_cols=0, split_cols=150, lane_sums=False,
                               keep_l2_share=0.0),
            "split-rows-lanes-keep-tail": dict(block_v=32, split_min_cols=0, split_cols=150, lane_sums=True,
                                               lane_sums_min_rows=0, keep_l2_share=2e-5),
            "split-rows-no-prefetch": dict(block_v=32, split_min_cols=0, split_cols=150, lane_sums=False,
                                           keep_l2_share=0.0, prefetch_pass2=False)}


def _use(tune, settings):
    tune(_ce_core, **settings)


def _check_case(tune, settings, dtype, case, **extra):
    """CASES[case] on 7 fresh rows of logits ~N(0, 9) under SETTINGS[settings]."""
    _use(tune, SETTINGS[settings])
    opts, reduction = CASES[case]
    vocab = (67, 300, 517)[case % 3]
    logits = (torch.randn(7, vocab, device=DEVICE) * 3).to(dtype)
    _check(logits, _labels(7, vocab), reduction, **opts, **extra)


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(tune, settings, dtype, case):
    _check_case(tune, settings, dtype, case)


@pytest.mark.parametrize("opts", [dict(), dict(z_loss=1e-3)])
def test_masked_vocabulary_tail(tune, opts):
    """Logits of −inf over whole blocks (a padded vocabulary masked out) add nothing: finite loss, zero gradient
    there, the rest as the reference. (Smoothing's mean over −inf logits is −inf by definition; a softcap maps −inf
    to a finite logit.)"""
    tune(_ce_core, block_v=64)
    vocab = 300
    logits = torch.randn(5, vocab, device=DEVICE) * 3
    logits[:, 190:] = float("-inf")  # blocks 3 and 4 entirely, block 2 partly
    labels = torch.randint(0, 190, (5,), device=DEVICE)
    loss, dx = _check(logits, labels, "sum", **opts)
    assert torch.isfinite(loss) and torch.equal(dx[:, 190:], torch.zeros_like(dx[:, 190:]))


@pytest.mark.parametrize("settings", SETTINGS)
def test_in_place_gradient(tune, settings):
    """Logits that are an autograd intermediate receive their gradient in place (no second N×V buffer); the target's
    logit dominates each row, so a kernel reading it after the gradient overwrote it would be far off."""
    _use(tune, SETTINGS[settings])
    opts, _ = CASES[-2]  # every option, reduction="mean": the gradient is computed in the forward
    labels = _labels(9, 300)
    logits = torch.randn(9, 300, device=DEVICE) * 3
    logits[torch.arange(9), labels.clamp(min=0)] += 8  # the target's term dominates lse: a stale x_t would show
    leaf = logits.to(torch.bfloat16).requires_grad_()
    inter = leaf * 1
    loss = cross_entropy(inter, labels, **opts)
    loss.backward()
    x64 = leaf.detach().double().requires_grad_()
    loss64 = cross_entropy_reference(x64, labels, **opts)
    loss64.backward()
    xe = leaf.detach().clone().requires_grad_()
    cross_entropy_reference(xe, labels, **opts).backward()
    assert_matches(loss, loss64.detach(), name="loss")
    assert_matches(leaf.grad, x64.grad, eager=xe.grad, name="dlogits")
    assert torch.equal(inter.detach(), leaf.grad), "the gradient was not written over the logits"


@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_incoming_grad_scales_the_in_place_gradient(grad_scale):
    """mean/sum keep the gradient from the forward; backward multiplies by grad_output (skipped when it is 1)."""
    logits = torch.randn(5, 300, device=DEVICE)
    _check(logits, _labels(5, 300), "mean", grad_scale=grad_scale)


@pytest.mark.parametrize("g", [1.0, -0.375])
def test_scale_in_place_strides_over_large_tensors(g):
    """_loss_common.scale_ runs a capped grid that strides (more blocks than programs here), and skips g == 1."""
    x = torch.randn(_loss_common.TUNING.scale_block * 41 + 123, device=DEVICE).to(torch.bfloat16)
    expected = (x.float() * g).to(torch.bfloat16)
    _loss_common.scale_(x, torch.tensor(g, device=DEVICE))
    assert torch.equal(x, expected)


def test_normaliser_tensor_and_number():
    logits, labels = torch.randn(6, 67, device=DEVICE), _labels(6, 67)
    total = cross_entropy(logits, labels, reduction="sum")
    for norm in (13, torch.tensor(13.0, device=DEVICE)):
        torch.testing.assert_close(cross_entropy(logits, labels, normalizer=norm), total / 13)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_one_element_normaliser_tensor(shape):
    """A count of shape (1,) (an all-reduced tensor([n])) is the normaliser, not a per-row scale: it was read at
    every row's offset (out of bounds: wrong gradients, a crash in the interpreter) and gave a (1,)-shaped loss."""
    logits, labels = torch.randn(6, 67, device=DEVICE), _labels(6, 67)
    loss, _ = _check(logits, labels, "mean", normalizer=torch.full(shape, 13.0, device=DEVICE))
    assert loss.shape == ()


@pytest.mark.parametrize("opts", [dict(normalizer=-4), dict(normalizer=float("nan")),
                                  dict(normalizer=torch.tensor([3.0, 4.0])), dict(z_loss=-1e-4),
                                  dict(z_loss=float("nan")), dict(softcap=float("inf"))])
def test_bad_option_values_raise(opts):
    """Values that gave a negative or NaN loss without a word (softcap=inf: inf·tanh(x/inf) is inf·0)."""
    logits, labels = torch.randn(4, 67, device=DEVICE), _labels(4, 67)
    with pytest.raises(ValueError, match=next(iter(opts))):
        cross_entropy(logits, labels, **opts)
    for reduction in ("sum", "none"):  # a normaliser there was silently unused
        with pytest.raises(ValueError, match="normalizer divides"):
            cross_entropy(logits, labels, reduction=reduction, normalizer=torch.tensor(13.0, device=DEVICE))
    if "normalizer" not in opts:
        with pytest.raises(ValueError, match=next(iter(opts))):
            CrossEntropyLoss(**opts)


@pytest.mark.parametrize("settings", SETTINGS)
def test_confident_prediction_keeps_target_gradient(tune, settings):
    """A logit 30 above the rest in bf16: p_t − 1 ≈ −V·e⁻³⁰ must come out relative-accurate, not 0 (targets in
    whole blocks and in the partial last one)."""
    _use(tune, SETTINGS[settings])
    vocab = 300
    logits = torch.randn(4, vocab, device=DEVICE)
    labels = torch.tensor([3, 140, 255, 299], device=DEVICE)
    rows = torch.arange(4, device=DEVICE)
    logits[rows, labels] = logits.max() + 30
    logits = logits.to(torch.bfloat16)
    loss, dx = _check(logits, labels, "sum", grad_scale=1.0)
    x64 = logits.double()
    # q = 1 − p_t ≈ 3e-13 as the non-target mass Σ_{j≠t} p_j: 1 − p_t itself would cancel to ~1e-3 relative
    # error even in float64 (its spacing at 1 is 1.1e-16), which made this reference fail a CI run.
    others = x64.masked_fill(torch.nn.functional.one_hot(labels, vocab).bool(), float("-inf"))
    q64 = torch.exp(torch.logsumexp(others, -1) - torch.logsumexp(x64, -1))
    assert (q64 > 0).all()
    torch.testing.assert_close(-dx[rows, labels].double(), q64, rtol=1e-2, atol=0)
    torch.testing.assert_close(loss.double(), -torch.log1p(-q64).sum(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("vocab", [1, 2, 5])
@pytest.mark.parametrize("opts", [dict(label_smoothing=1.0), dict(label_smoothing=0.6, z_loss=0.1, softcap=2.0)])
def test_tiny_vocabulary_strong_options(vocab, opts):
    """Every option's term at full weight. The cases above (V ≥ 67, ε ≤ 0.2, z ≤ 1e-2) leave a gradient term like
    ε/V, vs ε/(V − 1) of the other smoothing convention, below fp32 tolerance (ε·(1/(V−1) − 1/V)·scale ≤ 2e-6
    there); V = 1 and 2 are the vocabularies where such terms are largest. sum, incoming gradient 1: the gradient
    is O(1), so assert_matches' floor of 1 on the scale loosens nothing."""
    logits = torch.randn(6, vocab, device=DEVICE) * 2
    labels = torch.randint(0, vocab, (6,), device=DEVICE)
    labels[2] = IGNORE
    _, dx = _check(logits, labels, "sum", grad_scale=1.0, **opts)
    assert torch.equal(dx[2], torch.zeros_like(dx[2])), "an ignored row's gradient must be exactly 0"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    logits = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    labels = torch.full((4,), IGNORE, device=DEVICE)
    loss = cross_entropy(logits, labels, reduction=reduction, z_loss=1e-2, label_smoothing=0.1)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("bad", [67, 1000, -1, -101])
def test_bad_label_raises(bad):
    """The first bad label is named, and logits that would take the gradient in place are left as they were."""
    labels = _labels(6, 67)
    labels[1], labels[4] = bad, 67
    leaf = torch.randn(6, 67, device=DEVICE, requires_grad=True)
    inter = leaf * 1
    before = inter.detach().clone()
    with pytest.raises(ValueError, match=f"label {bad} is outside .*2 such labels"):
        cross_entropy(inter, labels, inplace_grad=True)
    assert torch.equal(inter.detach(), before)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_check_counts_and_scale(dtype, reduction):
    """LabelCheck's one-program kernel over several blocks: bad-label count, first bad index, and the scale."""
    n, vocab = 2 * label_check.TUNING.block + 37, 1000
    labels = torch.randint(-3, vocab + 3, (n,), device=DEVICE)
    labels[torch.rand(n, device=DEVICE) < 0.3] = IGNORE
    bad = ((labels < 0) | (labels >= vocab)) & (labels != IGNORE)
    check = label_check.LabelCheck(labels.to(dtype), vocab, IGNORE, reduction, loss_scale=0.5)
    assert check.flag.tolist() == [int(bad.sum()), int(bad.nonzero()[0])]
    expected = 0.5 / (labels != IGNORE).sum().item() if reduction == "mean" else 0.5
    torch.testing.assert_close(check.scale, torch.tensor(expected, device=DEVICE), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=f"label {labels[bad][0].item()} is outside .*{int(bad.sum())} such"):
        check.wait()
    check = label_check.LabelCheck(torch.full_like(labels, IGNORE).to(dtype), vocab, IGNORE, reduction, loss_scale=0.5)
    check.wait()  # all ignored: no error, and a mean's denominator counts as 1
    assert check.flag[0].item() == 0 and check.scale.item() == 0.5


@pytest.mark.parametrize("settings", ["default", "128-col-blocks-lanes"])
def test_kernel_touches_nothing_when_the_label_check_failed(tune, settings):
    """The row kernel reads LabelCheck's flag (on CUDA the host learns the verdict only after the kernel is queued):
    set, it writes no loss, statistic or gradient, in place or not."""
    _use(tune, SETTINGS[settings])
    logits = torch.randn(5, 300, device=DEVICE).to(torch.bfloat16)
    labels = _labels(5, 300)
    labels[2] = 300
    flag = label_check.LabelCheck(labels, 300, IGNORE).flag
    assert flag.tolist() == [1, 2]
    before = logits.clone()
    outs = [torch.full((5,), float("nan"), device=DEVICE) for _ in range(3)]
    grad = torch.full_like(logits, 7.0)
    opts = dict(ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, softcap=None, label_flag=flag)
    scale = torch.ones((), device=DEVICE)
    _ce_core.ce_rows(logits, labels, grad=grad, loss=outs[0], lse=outs[1], q=outs[2], rank=None, scale=scale, **opts)
    _ce_core.ce_rows(logits, labels, grad=logits, loss=outs[0], lse=outs[1], q=outs[2], rank=None, scale=scale,
                     **opts)
    assert torch.equal(logits, before) and bool((grad == 7).all())
    assert all(bool(o.isnan().all()) for o in outs)


def _check_in_place(logits, labels):
    """reduction="sum" on an intermediate: the gradient lands over the logits and matches the float64 reference."""
    leaf = logits.clone().requires_grad_()
    inter = leaf * 1
    cross_entropy(inter, labels, reduction="sum").backward()
    x64 = logits.double().requires_grad_()
    cross_entropy_reference(x64, labels, reduction="sum").backward()
    assert torch.equal(inter.detach(), leaf.grad)
    assert_matches(leaf.grad, x64.grad, name="dlogits in place")


@pytest.mark.parametrize("settings", ["split-rows", "split-rows-no-prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_targets_in_every_kind_of_block(tune, settings, dtype):
    """V = 517 in 32-column blocks over 4 programs of 4 whole blocks ([128k, 128k + 128)), the last one also on the
    partial block [512, 517): targets in the block each program loads for pass 2 before the meeting (the last whole
    block of its segment: 96.., 224.., 352.., 480..), at a segment's first column, and in the partial block; the
    gradient written over the logits, whose targets dominate (a stale read would be far off)."""
    _use(tune, SETTINGS[settings])
    labels = torch.tensor([96, 127, 229, 383, 480, 511, 514, 0, 128, IGNORE], device=DEVICE)
    logits = torch.randn(len(labels), 517, device=DEVICE) * 2
    valid = labels != IGNORE
    logits[valid.nonzero()[:, 0], labels[valid]] += 6
    logits = logits.to(dtype)
    _check(logits, labels, "mean", label_smoothing=0.1)
    _check_in_place(logits, labels)


@pytest.mark.parametrize("prefetch", [True, False])
def test_split_never_leaves_a_program_without_columns(tune, prefetch):
    """V = 18 whole 32-column blocks + 5: splitting over 8 programs (150 columns each, rounded up to a power of two)
    would give segments of 3 blocks and leave the last two programs none, and such a program would prefetch (and
    write) a neighbour's block. The split shrinks to 4 programs of 5 blocks instead; in place, targets everywhere."""
    _use(tune, dict(block_v=32, split_min_cols=0, split_cols=80, lane_sums=False,
                           keep_l2_share=0.0, prefetch_pass2=prefetch))
    assert _ce_core._split(18 * 32 + 5, 32) == (4, 5 * 32)
    assert _ce_core._split(15 * 32 + 7, 32) == (8, 2 * 32)  # 8 programs of 2 blocks: the last has 1 and the tail
    labels = torch.tensor([0, 95, 160, 511, 544, 575, 580, 300, IGNORE], device=DEVICE)
    logits = torch.randn(len(labels), 18 * 32 + 5, device=DEVICE) * 2
    valid = labels != IGNORE
    logits[valid.nonzero()[:, 0], labels[valid]] += 6
    _check_in_place(logits, labels)


@pytest.mark.parametrize("settings", ["default", "split-rows"])
def test_loss_total_is_deterministic(tune, settings):
    """mean / sum: the per-row losses summed in one fixed order (scaled_sum: one program on CUDA), times the scale: the
    same bits on every call, and the per-row losses' sum."""
    _use(tune, SETTINGS[settings])
    logits = torch.randn(7, 517, device=DEVICE)
    labels = _labels(7, 517)
    for reduction in ("sum", "mean"):
        totals = [cross_entropy(logits, labels, reduction=reduction) for _ in range(3)]
        per_row = cross_entropy(logits, labels, reduction="none")
        denominator = (labels != IGNORE).sum() if reduction == "mean" else 1
        assert totals[0].shape == () and all(torch.equal(t, totals[0]) for t in totals[1:])
        torch.testing.assert_close(totals[0], per_row.sum() / denominator, rtol=1e-6, atol=0)


def test_scaled_sum_over_several_blocks():
    """Against an fp64 sum times the same fp32 g: the product is rounded once (rtol 2⁻²⁴), and the fp32 sum is
    within the worst-case bound of its summation tree, depth ≤ 32 (≤ 3 terms per accumulator, ≤ 16 per thread,
    5 shuffle and 4 cross-warp levels): 32·2⁻²⁴·Σ|x|. A cancelling sum of randn needs that absolute bound (relative
    to the small result a 1e-6 rtol failed); an element dropped or counted twice is off by ~1, far beyond it."""
    x = torch.randn(2 * _loss_common.TUNING.sum_block + 13, device=DEVICE)
    g = torch.tensor(0.37, device=DEVICE)
    bound = 32 * 2.0**-24 * x.double().abs().sum().item() * g.item()
    out = _loss_common._launch_scaled_sum(x, g)  # the kernel itself, on the CPU too
    torch.testing.assert_close(out.double(), x.double().sum() * g.double(), rtol=2**-24, atol=bound)
    assert _loss_common._launch_scaled_sum(x[:0], g).item() == 0.0


def test_custom_ignore_index_and_bad_options():
    logits = torch.randn(5, 67, device=DEVICE)
    labels = _labels(5, 67)
    labels[2] = -1
    _check(logits, labels, "mean", ignore_index=-1)
    # A vocabulary id as ignore_index (a pad token's, as some trainers pass it): rows labelled 0 are ignored, not
    # trained on; a kernel that took "ignored" to mean "negative" passes the check above but not this one.
    labels = _labels(5, 67)
    labels[1], labels[2] = 0, 5  # rows 0 and 1 ignored (no -100 left: with ignore_index=0 it is a bad label)
    loss, dx = _check(logits, labels, "sum", ignore_index=0, label_smoothing=0.1)
    assert torch.equal(dx[:2], torch.zeros_like(dx[:2]))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(ValueError, match="do not match"):
        cross_entropy(logits, labels[:-1])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_logits_without_a_vocabulary_raise(requires_grad):
    """A 0-dim logits tensor and an empty vocabulary are caller errors: before, an IndexError and a reshape error from
    deep inside the call (every label of a V = 0 vocabulary is ignored or bad, so there is no loss to give)."""
    with pytest.raises(ValueError, match=r"logits must be \(\.\.\., V\) .*got shape \(\)"):
        cross_entropy(torch.randn((), device=DEVICE, requires_grad=requires_grad),
                      torch.zeros((), dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"V >= 1, got shape \(3, 0\)"):
        cross_entropy(torch.randn(3, 0, device=DEVICE, requires_grad=requires_grad),
                      torch.full((3,), IGNORE, device=DEVICE))


def test_strided_logits():
    """A transposed view (copied) and a row-strided slice (used in place through its row stride)."""
    labels = _labels(6, 67)
    _check(torch.randn(67, 6, device=DEVICE).t(), labels, "mean")
    _check(torch.randn(6, 80, device=DEVICE)[:, 5:72], labels, "sum")
    _check(torch.randn(2, 3, 67, device=DEVICE), labels.view(2, 3), "none")


@pytest.mark.parametrize("layout", ["every_other", "expanded", "column"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_strided_labels(layout, reduction):
    """1-D label views that are not contiguous (reshape(-1) keeps them as views): the kernels index labels by row."""
    if layout == "every_other":
        labels = torch.stack((_labels(6, 67), _labels(6, 67)), dim=1)[:, 1]
    elif layout == "expanded":
        labels = torch.tensor(66, device=DEVICE).expand(6)
    else:  # one position of every sequence: a column of a (6, T) batch
        labels = torch.randint(0, 67, (6, 5), device=DEVICE)[:, 2]
    assert not labels.is_contiguous()
    _check(torch.randn(6, 67, device=DEVICE) * 3, labels, reduction)
    label_check.check_labels(labels, 67, IGNORE)  # every label is valid: the check must see them as they are


def test_double_backward_raises():
    """create_graph=True must fail clearly, not hand out gradients without their second-order terms."""
    x = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    for reduction, inplace in (("mean", None), ("mean", False), ("sum", False), ("none", None)):
        loss = cross_entropy(x * 1.0, _labels(4, 67), reduction=reduction, inplace_grad=inplace).sum()
        with pytest.raises(RuntimeError, match="create_graph"):
            torch.autograd.grad(loss, x, create_graph=True)


def test_in_place_contract():
    """Default: in place for a non-view intermediate, never for a leaf or a view; versions are bumped."""
    labels = _labels(6, 67)
    leaf = torch.randn(6, 67, device=DEVICE, requires_grad=True)
    kept = leaf.detach().clone()
    cross_entropy(leaf, labels).backward()
    assert torch.equal(leaf.detach(), kept), "a leaf's values must survive"
    # intermediate: the gradient goes into its buffer and still reaches the leaf correctly
    w = torch.randn(6, 67, device=DEVICE, requires_grad=True)
    inter = w * 2.0
    version = inter._version
    cross_entropy(inter, labels).backward()
    assert inter._version > version
    ref = w.detach().double().requires_grad_()
    cross_entropy_reference(ref * 2.0, labels).backward()
    assert_matches(w.grad, ref.grad, name="upstream grad")
    # a view: its base (what HF returns as outputs.logits) is left alone
    base = w.detach().clone().requires_grad_() * 1.0
    before = base.detach().clone()
    cross_entropy(base.view(2, 3, 67), labels.view(2, 3)).backward()
    assert torch.equal(base.detach(), before)
    # a node that saved the logits (tanh saves its output) fails loudly instead of using the gradient
    with pytest.raises(RuntimeError, match="inplace"):
        cross_entropy(torch.tanh(w), labels).backward()
    with pytest.raises(RuntimeError, match="inplace"):
        cross_entropy(torch.tanh(w), labels, reduction="none").sum().backward()
    cross_entropy(torch.tanh(w), labels, inplace_grad=False).backward()


def test_second_backward_raises():
    """The gradient is computed in forward and handed out once; retain_graph must not scale it twice."""
    x = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    loss = cross_entropy(x * 1.0, _labels(4, 67))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_no_grad_and_module():
    logits, labels = torch.randn(5, 300, device=DEVICE), _labels(5, 300)
    with torch.no_grad():
        loss = CrossEntropyLoss(label_smoothing=0.1)(logits, labels)
    assert_matches(loss, cross_entropy_reference(logits.double(), labels, label_smoothing=0.1), name="loss")


# ---------------------------------------------------------------------------------------------------------------
# use_token_scaling (each token's loss and gradient times its detached target probability: TRL's DFT loss; pass 1
# and pass 2 in separate launches with p_t between them) and return_predicted_tokens (the argmax of each row, read
# before the gradient may overwrite the logits).


@pytest.mark.parametrize("settings", ["default", "128-col-blocks-lanes", "split-rows", "split-rows-lanes-keep-tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_token_scaling_matches_reference(tune, settings, dtype, case):
    """Every option and reduction with p_t scaling, rows whole or split over programs (pass 2 alone: no meeting)."""
    _check_case(tune, settings, dtype, case, use_token_scaling=True)


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_with_label_smoothing(tune, settings, dtype, reduction):
    """The kernel reads the class weights in both passes (the smoothing term ε/V·Σ_j w_j·(lse − x_j) and the
    gradient's ε/V·w_j per column), over whole, target, masked and split blocks; the reference is torch's own
    F.cross_entropy(weight=w, label_smoothing=ε). One target has weight 0 (its smoothing term remains); z-loss and a
    softcap ride along on the 517-column rows."""
    _use(tune, SETTINGS[settings])
    for vocab, extra in ((300, {}), (517, dict(z_loss=1e-3, softcap=5.0))):
        labels = _labels(7, vocab)
        weights = torch.rand(vocab, device=DEVICE) + 0.25
        weights[labels[labels >= 0][0]] = 0.0
        logits = (torch.randn(7, vocab, device=DEVICE) * 3).to(dtype)
        loss, _ = _check(logits, labels, reduction, class_weights=weights, label_smoothing=0.2, **extra)
        if not extra:
            torch_loss = F.cross_entropy(logits.double(), labels, weight=weights.double(), label_smoothing=0.2,
                                         reduction=reduction)
            assert_matches(loss, torch_loss, name="loss vs torch", scale_floor=1.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_scaling_with_class_weights(reduction):
    """Each token's weighted loss times p_t; the weighted mean's denominator Σ w_t as without scaling."""
    logits = torch.randn(9, 300, device=DEVICE) * 3
    _check(logits, _labels(9, 300), reduction, use_token_scaling=True, z_loss=1e-3,
           class_weights=torch.rand(300, device=DEVICE) + 0.5)


@pytest.mark.parametrize("settings", ["default", "split-rows"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_scaling_in_place(tune, settings, reduction):
    """The gradient written over the logits: p_t needs the target's logit, read before pass 2 overwrites it (the
    target dominates each row, so a stale x_t would give p_t far off)."""
    _use(tune, SETTINGS[settings])
    labels = _labels(9, 300)
    logits = torch.randn(9, 300, device=DEVICE) * 3
    logits[torch.arange(9), labels.clamp(min=0)] += 6
    leaf = logits.to(torch.bfloat16).requires_grad_()
    inter = leaf * 1
    g = torch.randn(9, device=DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE)
    loss = cross_entropy(inter, labels, reduction=reduction, use_token_scaling=True, softcap=20.0)
    (loss * g).sum().backward()
    x64 = leaf.detach().double().requires_grad_()
    loss64 = cross_entropy_reference(x64, labels, reduction=reduction, use_token_scaling=True, softcap=20.0)
    (loss64 * g.double()).sum().backward()
    xe = leaf.detach().clone().requires_grad_()
    eager = cross_entropy_reference(xe, labels, reduction=reduction, use_token_scaling=True, softcap=20.0)
    (eager * g).sum().backward()
    assert_matches(loss, loss64.detach(), name="loss", scale_floor=1.0)
    assert_matches(leaf.grad, x64.grad, eager=xe.grad, name="dlogits")
    if reduction == "mean":
        assert torch.equal(inter.detach(), leaf.grad), "the gradient was not written over the logits"


def test_token_scaling_strided_and_module():
    """A transposed view (copied) and a row-strided slice (in place through its stride); the module's option."""
    labels = _labels(6, 67)
    _check(torch.randn(67, 6, device=DEVICE).t() * 3, labels, "mean", use_token_scaling=True)
    _check(torch.randn(6, 80, device=DEVICE)[:, 5:72] * 3, labels, "none", use_token_scaling=True, z_loss=1e-3)
    logits = torch.randn(6, 67, device=DEVICE) * 3
    loss = CrossEntropyLoss(reduction="sum", use_token_scaling=True)(logits, labels)
    want = cross_entropy_reference(logits.double(), labels, reduction="sum", use_token_scaling=True)
    assert_matches(loss, want, name="module loss", scale_floor=1.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_scaling_all_ignored(reduction):
    logits = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    labels = torch.full((4,), IGNORE, device=DEVICE)
    loss = cross_entropy(logits * 1, labels, reduction=reduction, z_loss=1e-2, use_token_scaling=True)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def _assert_predictions(predicted, logits, labels, softcap=None):
    """predicted (int64, labels' shape) is the float64 argmax of the (capped) logits, -1 where ignored. The logits
    are exact in fp32, so a row's prediction is checked wherever the top two are tied exactly (both take the lowest
    index) or further apart than fp32 rounding of the cap can move them."""
    assert predicted.dtype == torch.int64 and predicted.shape == labels.shape
    valid = labels != IGNORE
    assert torch.equal(predicted[~valid], torch.full_like(predicted[~valid], -1))
    x = logits.double()
    x = x if softcap is None else softcap * torch.tanh(x / softcap)
    top2 = x.topk(2, -1).values
    gap = top2[..., 0] - top2[..., 1]
    clear = valid & ((gap == 0) | (gap > 1e-5 * x.abs().amax(-1)))
    assert clear.sum() >= valid.sum() - 2
    assert torch.equal(predicted[clear], x.argmax(-1)[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", [dict(), dict(softcap=4.0, use_token_scaling=True, return_token_accuracy=True)])
def test_predicted_tokens_before_the_in_place_gradient(dtype, reduction, opts):
    """The logits an intermediate, the gradient written over them: the predictions are the argmax of the logits as
    they were (ties: an all-equal row predicts 0), the loss and gradient as without them."""
    vocab = 517
    labels = _labels(9, vocab)
    logits = (torch.randn(9, vocab, device=DEVICE) * 3).to(dtype)
    logits[2] = 1.0
    leaf = logits.clone().requires_grad_()
    out = cross_entropy(leaf * 1, labels, reduction=reduction, return_predicted_tokens=True, **opts)
    plain = cross_entropy(logits.clone().requires_grad_() * 1, labels, reduction=reduction, **opts)
    plain = plain.loss if isinstance(plain, tuple) else plain
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=0)
    _assert_predictions(out.predicted_tokens, logits, labels, opts.get("softcap"))
    assert out.predicted_tokens[2] == 0
    assert not out.predicted_tokens.requires_grad


def test_predicted_tokens_strided_and_batched():
    """(B, T, V) logits: predictions of labels' shape; a transposed view of the logits (copied first)."""
    labels = _labels(6, 67).view(2, 3)
    logits = torch.randn(2, 3, 67, device=DEVICE) * 3
    out = cross_entropy(logits, labels, reduction="none", return_predicted_tokens=True)
    _assert_predictions(out.predicted_tokens, logits, labels)
    swapped = logits.reshape(6, 67).t().contiguous().t()
    out = cross_entropy(swapped, labels.reshape(6), return_predicted_tokens=True)
    _assert_predictions(out.predicted_tokens, logits.reshape(6, 67), labels.reshape(6))


# ---------------------------------------------------------------------------------------------------------------
# GPU: real sizes (the lead runs `pytest -m gpu` on the H200)


def _gpu_reference_rows(logits, labels, rows, **opts):
    """fp32 reference loss terms and gradient for a subset of rows (the full fp32 copy would not fit twice)."""
    x = logits[rows].float().requires_grad_()
    loss = cross_entropy_reference(x, labels[rows], reduction="sum", **opts)
    (g,) = torch.autograd.grad(loss, x)
    return loss, g


# Real-size settings: the default (per-thread partial sums in pass 1 from 4096 rows on, ptxas capped at 32 registers
# on rows up to 128K wide; pass 1's loads evict_last only in the tail a resident row may keep of 60% of L2), per-block
# sums, every pass-1 load evict_last, the 32-register cap at every width, no cap (57 registers, one program/SM), one
# program per row at every width (the default splits 256000 over 4), and every row over 64K columns split (128256
# over 2 programs, 152064 and 256000 over 4).
GPU_SETTINGS = {"default": {}, "block-sums": dict(lane_sums=False), "all-evict-last": dict(keep_l2_share=0.0),
                "32-registers-any-width": dict(max_registers_cols=1 << 30),
                "no-register-cap": dict(max_registers=None), "no-split": dict(split_cols=None),
                "split-over-64k": dict(split_min_cols=65536),
                "split-no-prefetch": dict(prefetch_pass2=False)}


@pytest.mark.gpu
@pytest.mark.parametrize("settings", GPU_SETTINGS)
@pytest.mark.parametrize("n, vocab", [(8192, 128256), (4096, 256000), (3, 152064)])
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)])
def test_gpu_headline_shapes(tune, settings, n, vocab, opts):
    _use(tune, GPU_SETTINGS[settings])
    torch.manual_seed(0)
    logits = (torch.randn(n, vocab, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = IGNORE
    ref = cross_entropy_reference(logits, labels, reduction="sum", **opts)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, labels, reduction="sum", inplace_grad=False, **opts)
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    rows = torch.arange(0, n, 997 if n > 997 else 1, device="cuda")
    _, g = _gpu_reference_rows(logits, labels, rows, **opts)
    assert_matches(x.grad[rows], g.double(), name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, split_cols", [(128256, None), (256000, None), (256000, 65536)])
def test_gpu_class_weights_with_label_smoothing(tune, vocab, split_cols):
    """The compiled kernel's class-weighted smoothing (w read in both passes) on bf16 rows whole and split over
    programs, with z-loss, against the fp32 reference on the same values (sum: sampled rows are self-contained)."""
    tune(_ce_core, split_cols=split_cols, split_min_cols=0 if split_cols else _ce_core.TUNING.split_min_cols)
    n = 1031
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::9] = IGNORE
    weights = torch.rand(vocab, device="cuda") + 0.25
    weights[labels[1]] = 0.0  # a target of weight 0 keeps its smoothing term
    logits = (torch.randn(n, vocab, device="cuda") * 2).to(torch.bfloat16)
    opts = dict(class_weights=weights, label_smoothing=0.1, z_loss=1e-4)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, labels, reduction="sum", **opts)
    loss.backward()
    ref = cross_entropy_reference(logits, labels, reduction="sum", **opts)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    rows = torch.arange(0, n, 97, device="cuda")
    _, g = _gpu_reference_rows(logits, labels, rows, **opts)
    assert_matches(x.grad[rows], g.double(), name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("split_cols", [131072, 65536])
def test_gpu_split_rows_in_place(tune, split_cols):
    """Rows split over 2 / 4 programs with the gradient written over the logits: every program reads its target
    logit before the meeting, so none can read a partner's gradient in its place (the target dominates each row,
    so a stale x_t would be far off); rows whose target lies in each segment, and ignored rows."""
    tune(_ce_core, split_cols=split_cols)
    n, vocab = 1031, 256000
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[: n // 2] = torch.arange(n // 2, device="cuda") * (vocab // (n // 2))  # targets across every segment
    labels[::9] = IGNORE
    logits = torch.randn(n, vocab, device="cuda") * 2
    valid = labels != IGNORE
    logits[valid.nonzero()[:, 0], labels[valid]] += 12
    logits = logits.to(torch.bfloat16)
    leaf = logits.clone().requires_grad_()
    inter = leaf * 1
    loss = cross_entropy(inter, labels, reduction="sum", label_smoothing=0.05)
    loss.backward()
    assert torch.equal(inter.detach(), leaf.grad), "the gradient was not written over the logits"
    torch.testing.assert_close(loss, cross_entropy_reference(logits, labels, reduction="sum", label_smoothing=0.05),
                               rtol=1e-5, atol=0)
    rows = torch.arange(0, n, 13, device="cuda")
    _, g = _gpu_reference_rows(logits, labels, rows, label_smoothing=0.05)
    assert_matches(leaf.grad[rows], g.double(), name="dlogits")


@pytest.mark.gpu
@pytest.mark.parametrize("settings", ["default", "no-split", "split-over-64k"])
@pytest.mark.parametrize("n, vocab", [(8192, 128256), (4096, 256000)])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_gpu_token_scaling_and_predictions_headline_shapes(tune, settings, n, vocab, reduction):
    """use_token_scaling (pass 1 and pass 2 as two launches, p_t between them; rows split over programs that meet in
    pass 1 only) with the gradient written over the logits, and return_predicted_tokens read before it: loss against
    the fp32 reference, dlogits of sampled rows against the fp32 reference's, predictions equal to the argmax of the
    capped fp32 logits (the same values, as the op computes them)."""
    _use(tune, GPU_SETTINGS[settings])
    torch.manual_seed(0)
    opts = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0, use_token_scaling=True)
    logits = (torch.randn(n, vocab, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::7] = IGNORE
    ref = cross_entropy_reference(logits, labels, reduction=reduction, **opts)
    capped = 30.0 * torch.tanh(logits.float() / 30.0)
    want = torch.where(labels != IGNORE, capped.argmax(-1), -1)
    del capped
    leaf = logits.clone().requires_grad_()
    inter = leaf * 1
    out = cross_entropy(inter, labels, reduction=reduction, return_predicted_tokens=True, **opts)
    out.loss.sum().backward()  # for "none" the gradient of the sum, as for reduction="sum"
    assert torch.equal(out.predicted_tokens, want)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-7)
    rows = torch.arange(0, n, 997, device="cuda")
    _, g = _gpu_reference_rows(logits, labels, rows, **opts)
    assert_matches(leaf.grad[rows], g.double(), name="dlogits")


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_logits_above_2_31_elements():
    """8500×256000 bf16 (2.18e9 elements, 4.4 GB): int64 row offsets; the last rows are checked."""
    n, vocab = 8500, 256000
    assert n * vocab > 2**31
    torch.manual_seed(0)
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    logits.requires_grad_()
    inter = logits * 1  # an intermediate: the gradient is written in place (no second 4.4 GB buffer)
    loss = cross_entropy(inter, labels, reduction="none")
    loss.sum().backward()
    rows = torch.tensor([0, 1, n // 2, n - 2, n - 1], device="cuda")
    ref_loss, g = _gpu_reference_rows(logits.detach(), labels, rows)
    torch.testing.assert_close(loss[rows].sum(), ref_loss, rtol=1e-5, atol=0)
    assert_matches(logits.grad[rows], g.double(), name="dlogits (last rows)")


@pytest.mark.gpu
def test_gpu_repeated_split_calls_and_host_flags(monkeypatch):
    """Launch after launch on one stream with rows split over 4 programs, the meeting counters taken from a ring that
    laps several times (a counter not zero would let a program merge before its partners published: a different
    loss). Bad and good label batches alternate: each verdict travels through pinned host memory that the check
    kernel writes directly, the buffers reused from call to call."""
    monkeypatch.setattr(_ce_meet, "COUNTER_RING", 5000)
    monkeypatch.setattr(_ce_meet, "_COUNTERS", {})
    n, vocab = 2048, 256000
    logits = (torch.randn(n, vocab, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::5] = IGNORE
    ref = cross_entropy_reference(logits, labels)
    first = cross_entropy(logits, labels)
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=0)
    for i in range(6):
        bad = labels.clone()
        bad[(i * 331) % n] = vocab + i
        with pytest.raises(ValueError, match=f"label {vocab + i} is outside .*1 such labels"):
            cross_entropy(logits, bad)
        assert torch.equal(cross_entropy(logits, labels), first)
    ((ring, used),) = _ce_meet._COUNTERS.values()
    assert ring.numel() == 5000 and used == n


@pytest.mark.gpu
def test_gpu_bad_label_raises_with_the_kernel_already_queued():
    """On CUDA the verdict reaches the host after the row kernel is queued: the call still raises, the in-place
    logits are untouched (the kernel saw the flag), and the next call with good labels is exact."""
    n, vocab = 4096, 32000
    logits = (torch.randn(n, vocab, device="cuda") * 2).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    bad = labels.clone()
    bad[n - 1] = vocab
    inter = logits.clone().requires_grad_() * 1
    with pytest.raises(ValueError, match=f"label {vocab} is outside .*1 such labels"):
        cross_entropy(inter, bad, inplace_grad=True)
    assert torch.equal(inter.detach(), logits)
    loss = cross_entropy(inter, labels, inplace_grad=True)
    torch.testing.assert_close(loss, cross_entropy_reference(logits, labels), rtol=1e-5, atol=0)


def test_losses_take_their_inputs_by_keyword():
    """The documented names work as keywords: the device wrapper took the first tensor positionally only
    (cross_entropy(logits=..., labels=...) raised "missing 1 required positional argument: 'x'")."""
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    logits, labels = torch.randn(5, 37, device=DEVICE), torch.randint(0, 37, (5,), device=DEVICE)
    assert torch.equal(cross_entropy(logits=logits, labels=labels), cross_entropy(logits, labels))
    hidden, weight = torch.randn(5, 8, device=DEVICE), torch.randn(37, 8, device=DEVICE)
    assert torch.equal(fused_linear_cross_entropy(hidden=hidden, weight=weight, labels=labels),
                       fused_linear_cross_entropy(hidden, weight, labels))


@pytest.mark.parametrize("grad_scale", [0.5, -1.0 / 3.0])
def test_in_place_gradient_on_a_row_strided_view(grad_scale):
    """inplace_grad=True on a slice of wider logits (a padded vocabulary cut to the real one): the gradient lives in
    the slice, row stride and all. backward's grad_output scaling walked it as if it were contiguous (scaled the gap
    and left the last rows' tails unscaled)."""
    labels = _labels(6, 67)
    wide = torch.randn(6, 80, device=DEVICE, requires_grad=True)
    loss = cross_entropy((wide * 1.0)[:, 5:72], labels, inplace_grad=True)
    (dx,) = torch.autograd.grad(loss, wide, torch.tensor(grad_scale, device=DEVICE))
    x64 = wide.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(cross_entropy_reference(x64[:, 5:72], labels) * grad_scale, x64)
    assert_matches(dx, dx64, name="dlogits")
