"""Medusa loss vs a float64 materialised-logits reference: loss, metrics and gradients for every option."""

import math

import pytest
import torch

from liger_models.kernels._dispatch import use_triton
from liger_models.medusa import MedusaModel, medusa_head_weights, medusa_target_counts, schedule_factor
from tests.helpers import assert_matches, rel_l2
from tests.medusa._common import float64_copies, make_base, packed_batch, reference_loss, reference_targets

V, H = 37, 16


def test_head_weights():
    assert medusa_head_weights(3) == pytest.approx([0.2 * 0.8, 0.2 * 0.64, 0.2 * 0.512])
    assert medusa_head_weights(2, lambda0=1.0, decay=0.5) == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize("name,step,max_steps,expected", [
    ("constant", 3, 10, 1.0), ("linear", 3, 10, 0.3), ("linear", 20, 10, 1.0),
    ("sine", 5, 10, math.sin(math.pi / 4)), ("sine", 0, 10, 0.0),
    ("sine_0.5", 1, 10, math.sin(math.pi / 2 * 0.2)), ("sine_0.5", 6, 10, 1.0),
    ("sine_1", 5, 10, math.sin(math.pi / 4)),
])
def test_schedule_factor(name, step, max_steps, expected):
    assert schedule_factor(name, step, max_steps) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["cos", "sine_0", "sine_x", "sine_1.5"])
def test_bad_schedule_raises(bad):
    with pytest.raises(ValueError, match="scheduler"):
        schedule_factor(bad, 0, 1)


def _check(model, ids, labels, pos, *, step=0, max_steps=1, w0=None):
    """Run the model and the reference; compare loss, metrics and every trainable parameter's gradient."""
    cfg = model.config
    base64, sd64 = float64_copies(model.base, model.heads)
    out = model(ids, labels=labels, position_ids=pos, step=step, max_steps=max_steps)
    out.loss.backward()
    scales = model.head_scales(step, max_steps)
    w0 = model.base_loss_weight if w0 is None else w0
    ref = reference_loss(base64, sd64, cfg, ids, labels, pos, w0=w0, scales=scales, stage=model.stage)
    ref_loss, ref_base, ref_ces, ref_top1, ref_top5, ref_count = ref
    ref_loss.backward()
    assert_matches(out.loss.detach(), ref_loss.detach(), name="loss")
    assert_matches(out.head_losses, ref_ces, name="head_losses")
    if w0:
        assert_matches(out.base_loss, ref_base.detach(), name="base_loss")
    else:
        assert out.base_loss is None
    assert torch.equal(out.head_top1, ref_top1) and torch.equal(out.head_top5, ref_top5)
    assert torch.equal(out.head_count, ref_count)
    for name, p in model.heads.named_parameters():
        assert_matches(p.grad, sd64[name].grad, name=f"grad heads.{name}")
    for (name, p), (_, p64) in zip(model.base.named_parameters(), base64.named_parameters()):
        if model.stage == 1:
            assert p.grad is None, name
        else:
            assert_matches(p.grad, p64.grad, name=f"grad base.{name}")
    return out


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_loss_and_grads_match_reference(share, L, stage):
    model = MedusaModel.from_base(make_base(V, H), stage=stage, num_heads=3, num_layers=L, share_lm_head=share)
    for p in model.heads.parameters():  # move away from the zero init so every gradient path carries signal
        p.data.add_(0.1 * torch.randn_like(p))
    ids, labels, pos = packed_batch(2, 11, V, packed=True)
    _check(model, ids, labels, pos)


@pytest.mark.parametrize("share", [False, True])
def test_tied_embeddings(share):
    """Gemma-style tied lm_head: heads copy (or share) the embedding matrix; stage-2 grads reach it both ways."""
    base = make_base(V, H, tied=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = MedusaModel.from_base(base, stage=2, num_heads=2, share_lm_head=share)
    ids, labels, pos = packed_batch(2, 9, V, packed=True)
    _check(model, ids, labels, pos)


def test_with_triton_interpreter(interpreted_kernels):
    """The same check with every kernel (fused linear-CE included) running as Triton code in the interpreter."""
    assert use_triton(torch.empty(1))
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2, num_layers=1)
    ids, labels, pos = packed_batch(2, 7, V, packed=True)
    _check(model, ids, labels, pos)


@pytest.mark.parametrize("scheduler,step", [("linear", 3), ("sine", 2), ("sine_0.25", 1), ("linear", 0)])
def test_schedules_and_weights_scale_the_loss(scheduler, step):
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2, scheduler=scheduler,
                                  heads_coefficient=0.5, decay_coefficient=0.6, base_loss_weight=0.7)
    ids, labels, pos = packed_batch(2, 9, V, packed=False)
    out = _check(model, ids, labels, None, step=step, max_steps=8, w0=0.7)
    if step == 0:  # a zero weight still reports the head's CE, and its gradient is exactly zero
        assert (out.head_losses > 0).all()
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.heads.parameters())


def test_packed_boundaries_are_masked_for_every_head():
    ids = torch.randint(0, V, (1, 8))
    labels = ids.clone()
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    model = MedusaModel.from_base(make_base(V, H), num_heads=3)
    out = model(ids, labels=labels, position_ids=pos)
    # Documents of 4 tokens: head k (shift k+1) has 4-(k+1) targets per document.
    assert out.head_count.tolist() == [2 * 2, 2 * 1, 0]
    assert medusa_target_counts(labels, 3, pos).tolist() == [6, 4, 2, 0]
    assert torch.isfinite(out.loss) and out.head_losses[2] == 0
    counted = model(ids, labels=labels, position_ids=pos, normalizer=medusa_target_counts(labels, 3, pos))
    assert torch.isfinite(counted.loss) and counted.head_losses[2] == 0
    assert_matches(counted.loss.detach(), out.loss.detach().double(), name="same normalizers")


def test_global_normalizer_per_term_matches_one_big_batch():
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2)
    ids, labels, pos = packed_batch(4, 9, V, packed=True)
    full = model(ids, labels=labels, position_ids=pos)
    full.loss.backward()
    grads_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    counts = medusa_target_counts(labels, 2, pos)
    total = 0.0
    for half in (slice(0, 2), slice(2, 4)):
        out = model(ids[half], labels=labels[half], position_ids=pos[half], normalizer=counts)
        out.loss.backward()
        total += out.loss.detach()
    assert_matches(total, full.loss.detach().double(), name="accumulated loss")
    for g, p in zip(grads_full, model.parameters()):
        assert_matches(p.grad, g.double(), name="accumulated grad")


def test_scalar_normalizer():
    model = MedusaModel.from_base(make_base(V, H), num_heads=2, scheduler="constant")
    ids, labels, pos = packed_batch(2, 9, V, packed=False, ignore_frac=0.0)
    a = model(ids, labels=labels)
    b = model(ids, labels=labels, normalizer=torch.tensor(100.0))
    counts = medusa_target_counts(labels, 2)
    expected = sum(w * ce * c / 100 for w, ce, c in zip(model.head_scales(), a.head_losses, counts[1:]))
    assert_matches(b.loss.detach(), expected.double(), name="loss / 100")


def test_inference_forward_returns_logits():
    model = MedusaModel.from_base(make_base(V, H), num_heads=2, share_lm_head=True)
    ids = torch.randint(0, V, (2, 5))
    out = model(ids)
    assert out.loss is None and out.logits.shape == (2, 5, V) and out.head_logits.shape == (2, 2, 5, V)


def test_labels_shape_mismatch_raises():
    model = MedusaModel.from_base(make_base(V, H), num_heads=2)
    with pytest.raises(ValueError, match="labels"):
        model(torch.randint(0, V, (2, 5)), labels=torch.zeros(2, 4, dtype=torch.long))


def test_reference_targets_sanity():
    labels = torch.arange(6)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert reference_targets(labels, 2, pos).tolist() == [[2, -100, -100, 5, -100, -100]]


@pytest.mark.gpu
@pytest.mark.parametrize("share", [False, True])
def test_gpu_bf16_stage2_matches_float64_reference(share):
    """bf16 on the GPU (Triton kernels) vs the float64 CPU reference: loss, head CEs and the heads' gradients (the
    base's own bf16 gradients are the model tests' business; here they only have to exist)."""
    base = make_base(512, 128, torch.bfloat16, layers=2).cuda()
    model = MedusaModel.from_base(base, stage=2, num_heads=3, share_lm_head=share)
    for p in model.heads.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    base64, sd64 = float64_copies(model.base, model.heads)
    ids, labels, pos = packed_batch(2, 96, 512, packed=True)
    out = model(ids.cuda(), labels=labels.cuda(), position_ids=pos.cuda())
    out.loss.backward()
    ref = reference_loss(base64, sd64, model.config, ids, labels, pos, w0=1.0, scales=model.head_scales(), stage=2)
    ref[0].backward()
    # fp32 results of a bf16 computation: held to the bf16 bound.
    assert rel_l2(out.loss.detach().cpu(), ref[0].detach()) <= 1e-2
    assert rel_l2(out.head_losses.cpu(), ref[2]) <= 1e-2
    assert torch.equal(out.head_count.cpu(), ref[5])
    for name, p in model.heads.named_parameters():
        assert_matches(p.grad.cpu(), sd64[name].grad, name=f"grad heads.{name}")
    assert all(torch.isfinite(p.grad).all() for p in model.base.parameters())
