"""Medusa loss vs a float64 materialised-logits reference: loss, metrics and gradients for every option; bf16 stage 2
vs float64 within 2x of eager bf16 (interpreted kernels on CPU, Triton on the GPU)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from liger_models import reference_mode
from liger_models.kernels._dispatch import use_triton
from liger_models.medusa import (MedusaConfig, MedusaHeads, MedusaModel, medusa_head_weights, medusa_loss,
                                 medusa_target_counts, schedule_factor)
from tests.helpers import INTERPRETER_ONLY, assert_matches, rel_l2
from tests.medusa._common import (IGNORE, float64_copies, make_base, packed_batch, reference_loss, reference_targets,
                                  some_target_attends)

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
    if model.stage == 2:  # copied before the model's backward fills its .grad
        # The same reference in fp32: the base's attention gradients (k_proj's above all) are a softmax-backward
        # cancellation that fp32 arithmetic itself gets to only ~1e-5 of their scale (8.2e-6 at one CI seed).
        base32 = copy.deepcopy(model.base).float()
        sd32 = {k: v.detach().float().requires_grad_() for k, v in sd64.items()}
    out = model(ids, labels=labels, position_ids=pos, step=step, max_steps=max_steps)
    out.loss.backward()
    scales = model.head_scales(step, max_steps)
    w0 = model.base_loss_weight if w0 is None else w0
    ref = reference_loss(base64, sd64, cfg, ids, labels, pos, w0=w0, scales=scales, stage=model.stage)
    ref_loss, ref_base, ref_ces, ref_top1, ref_top5, ref_count = ref
    ref_loss.backward()
    if model.stage == 2:
        reference_loss(base32, sd32, cfg, ids, labels, pos, w0=w0, scales=scales, stage=2)[0].backward()
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
    if model.stage == 1:
        for name, p in model.base.named_parameters():
            assert p.grad is None, name
    else:
        for (name, p), (_, p64), (_, p32) in zip(model.base.named_parameters(), base64.named_parameters(),
                                                 base32.named_parameters()):
            assert_matches(p.grad, p64.grad, eager=p32.grad, name=f"grad base.{name}")
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


@INTERPRETER_ONLY
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


# bf16 against float64, under docs/kernels.md#correctness-protocol: every error (rel L2) at most 2x the error of an
# eager bf16 PyTorch implementation of the same computation (floor: one bf16 rounding), and at most 1e-2 where eager
# meets 1e-2.
#
# Where 1e-2 holds for eager too: in stage 2 the heads read the base's bf16 hidden states, which after two random
# layers (make_base's scaled-up init) are ~3% off the float64 ones, and every gradient downstream inherits that.
# Measured at the GPU test's size (H=128, V=512, 2x96 tokens; CPU, interpreted kernels, 3 seeds): the heads'
# gradients are 2-6% off for eager bf16 and ours alike (ours/eager 0.99-1.01; float64 heads fed those same bf16
# hidden states are already 2.5-4.5% off), the base's own 1-30%; loss and head CEs stay below 1.5e-3. Fed the SAME
# hidden states, the bf16 heads and loss add only 0.4-0.6% to any gradient. So the whole step is held to 2x eager
# (1e-2 on the loss and head CEs only), and the Medusa part alone, on fixed hidden states, to 2x eager AND 1e-2.
BF16_FLOOR = 4e-3  # one bf16 rounding: the bound for tensors that eager gets almost exactly


def _eager_loss(model, hidden, labels, pos, scales):
    """Medusa stage-2 loss in plain PyTorch at the model's dtype: every ResBlock on its own (nn.Linear + SiLU), every
    head's logits materialised in bf16, fp32 cross-entropy (HF's numerics). Returns (loss, head CEs)."""

    def ce(x, weight, shift):
        t = reference_targets(labels, shift, pos).flatten().to(x.device)
        logits = F.linear(x, weight).float().flatten(0, 1)
        return F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="sum") / (t != IGNORE).sum().clamp(min=1)

    loss = ce(hidden, model.base.lm_head.weight, 1)
    head_ces = []
    for k, scale in enumerate(scales):
        z = hidden
        for block in model.heads.resblocks(k):
            z = block(z)
        head_ces.append(ce(z, model.heads.weight(k), k + 2))
        loss = loss + scale * head_ces[-1]
    return loss, torch.stack(head_ces).detach()


def _bf16_errors(model, ids, labels, pos, *, fixed_hidden: bool) -> dict[str, tuple[float, float]]:
    """{name: (our rel-L2 error, eager bf16's)} against float64 for the loss, the head CEs and the gradients.

    fixed_hidden=False: the whole stage-2 step (base forward included), every trainable parameter's gradient.
    fixed_hidden=True: the Medusa part alone, on the base's bf16 hidden states (a leaf; float64 copy for the
    reference): the heads' and the base lm_head's gradients and the gradient w.r.t. the hidden states, which is
    what stage 2 backpropagates into the base.
    """
    device = model.base.lm_head.weight.device
    ids_d, labels_d, pos_d = ids.to(device), labels.to(device), pos.to(device)
    scales = model.head_scales()
    base64, sd64 = float64_copies(model.base, model.heads)
    named = {f"heads.{n}": (p, sd64[n]) for n, p in model.heads.named_parameters()}
    if fixed_hidden:
        with torch.no_grad(), reference_mode():  # only an input here: which kernels made it does not matter
            hidden = model.base.model(ids_d, position_ids=pos_d).requires_grad_()
        hidden64 = hidden.detach().cpu().double().requires_grad_()
        ref_base = SimpleNamespace(model=lambda *args, **kwargs: hidden64, lm_head=base64.lm_head)
        named["hidden"] = (hidden, hidden64)
        named["base.lm_head.weight"] = (model.base.lm_head.weight, base64.lm_head.weight)
    else:
        ref_base = base64
        for (n, p), (_, p64) in zip(model.base.named_parameters(), base64.named_parameters()):
            named[f"base.{n}"] = (p, p64)
    with reference_mode():  # float64 through the kernels' PyTorch references (on CPU they would be interpreted)
        ref_loss, _, ref_ces, *_ = reference_loss(ref_base, sd64, model.config, ids, labels, pos, w0=1.0,
                                                  scales=scales, stage=2)
        ref_loss.backward()

    if fixed_hidden:
        out = medusa_loss(hidden, model.heads, labels_d, position_ids=pos_d, base_lm_head_weight=
                          model.base.lm_head.weight, base_loss_weight=1.0, head_scales=scales)
    else:
        out = model(ids_d, labels=labels_d, position_ids=pos_d)
    out.loss.backward()
    assert torch.equal(out.head_count.cpu(), torch.stack([(reference_targets(labels, k + 2, pos) != IGNORE).sum()
                                                          for k in range(len(scales))]))
    ours = {n: p.grad for n, (p, _) in named.items()}
    for p, _ in named.values():
        p.grad = None
    with reference_mode():
        eager_hidden = hidden if fixed_hidden else model.base.model(ids_d, position_ids=pos_d)
        eager_loss, eager_ces = _eager_loss(model, eager_hidden, labels, pos, scales)
        eager_loss.backward()
    errors = {"loss": (rel_l2(out.loss.cpu(), ref_loss), rel_l2(eager_loss.cpu(), ref_loss)),
              "head_losses": (rel_l2(out.head_losses.cpu(), ref_ces), rel_l2(eager_ces.cpu(), ref_ces))}
    for n, (p, p64) in named.items():
        assert ours[n] is not None and ours[n].dtype == torch.bfloat16, n
        errors[f"grad {n}"] = (rel_l2(ours[n].cpu(), p64.grad), rel_l2(p.grad.cpu(), p64.grad))
    return errors


def _assert_within_eager(errors: dict[str, tuple[float, float]], absolute: tuple[str, ...] | None) -> None:
    """ours ≤ max(2·eager, one bf16 rounding) for every entry; ours ≤ 1e-2 too for the names in `absolute` (all
    when None). The 1e-2 set is fixed from measurements, not decided per run from eager's error, so an eager error
    that happens to land near 1e-2 cannot make the test flaky."""
    report = "\n".join(f"  {n}: ours {o:.3e}, eager bf16 {e:.3e}" for n, (o, e) in errors.items())
    for name, (ours, eager) in errors.items():
        assert ours <= max(2 * eager, BF16_FLOOR), f"{name}: ours {ours:.3e} > 2x eager bf16's {eager:.3e}\n{report}"
        if absolute is None or name in absolute:
            assert ours <= 1e-2, f"{name}: ours {ours:.3e} > 1e-2 (eager bf16: {eager:.3e})\n{report}"


def _bf16_stage2_model(vocab: int, hidden: int, layers: int, share: bool, device: str) -> MedusaModel:
    base = make_base(vocab, hidden, torch.bfloat16, layers=layers).to(device)
    model = MedusaModel.from_base(base, stage=2, num_heads=3, share_lm_head=share)
    for p in model.heads.parameters():  # away from the zero init, so every gradient path carries signal
        p.data.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("fixed_hidden,share", [(False, False), (True, False), (True, True)])
def test_bf16_stage2_within_2x_eager(fixed_hidden, share, interpreted_kernels):
    """bf16 stage 2 with every kernel interpreted (base, fused linear-CE) vs float64, and vs eager bf16. On CPU ours
    and eager agree to a few bf16 ulps (same GEMMs), so a Medusa-side slip of ~2% in any gradient fails here."""
    model = _bf16_stage2_model(128, 64, layers=1, share=share, device="cpu")  # 1 layer: the interpreter is slow
    ids, labels, pos = packed_batch(2, 24, 128, packed=True)
    errors = _bf16_errors(model, ids, labels, pos, fixed_hidden=fixed_hidden)
    _assert_within_eager(errors, absolute=None if fixed_hidden else ("loss", "head_losses"))


@pytest.mark.gpu
@pytest.mark.parametrize("fixed_hidden", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_gpu_bf16_stage2_within_2x_eager(share, fixed_hidden):
    """bf16 on the GPU (Triton kernels) vs the float64 CPU reference, against eager bf16 on the GPU."""
    model = _bf16_stage2_model(512, 128, layers=2, share=share, device="cuda")
    ids, labels, pos = packed_batch(2, 96, 512, packed=True)
    errors = _bf16_errors(model, ids, labels, pos, fixed_hidden=fixed_hidden)
    _assert_within_eager(errors, absolute=None if fixed_hidden else ("loss", "head_losses"))


# ---------------------------------------------------------------------------------------------------------------
# An independent materialised-logits reference, written from docs/medusa.md#loss-and-stages and the packing contract
# rather than from _common.py: every head's logits formed explicitly in float64, per-head mean CE on shifted labels,
# top-k counts from the materialised logits, and "no target across a document start" stated as "no position id 0 in
# (t, t + shift]" instead of shift_labels' position arithmetic.


def _contract_targets(labels: torch.Tensor, shift: int, pos: torch.Tensor | None) -> torch.Tensor:
    B, T = labels.shape
    out = torch.full((B, T), IGNORE, dtype=torch.long)
    for b in range(B):
        for t in range(T - shift):
            if pos is None or not bool((pos[b, t + 1:t + shift + 1] == 0).any()):
                out[b, t] = labels[b, t + shift]
    return out


def _random_batch(B: int, T: int, *, packed: bool, ignore_frac: float = 0.25):
    """Random ids, labels (a quarter ignored) and position ids (1-2 documents starting mid-row when packed), drawn
    again until some base-CE target is predicted from a query that sees two different tokens. Otherwise every such
    query's keys and values are alike (it sees only itself, or a document like [3, 3]), attention's softmax passes it
    no gradient, and the base's q/k gradients are zero by cancellation (float64 leaves 1e-16): an fp32 bound relative
    to that checks nothing and fails on fp32's 1e-8 (seed 1848400554). Packed rows of 3 tokens are three one-token
    documents by construction, their q/k gradients exactly zero."""
    attends = T > 3 if packed else T > 1  # whether a row can hold a token that sees another
    for _ in range(100):
        ids = torch.randint(0, V, (B, T))
        labels = torch.where(torch.rand(B, T) < ignore_frac, IGNORE, ids)
        pos = torch.arange(T).repeat(B, 1)
        if packed and T > 1:
            for b in range(B):
                for start in sorted(torch.randperm(T - 1)[:2].add(1).tolist()):
                    pos[b, start:] = torch.arange(T - start)
        if not attends or some_target_attends(ids, _contract_targets(labels, 1, pos), pos):
            return ids, labels, (pos if packed else None)
    raise AssertionError(f"no batch of {B}×{T} with a target whose query sees two different tokens in 100 draws")


def _materialised_reference(model, ids, labels, pos, sched: float, dtype=torch.float64):
    """(loss, base CE or None, head CEs, top1, top5, counts, head grads by name, base grads or None) in ``dtype``:
    float64 is the truth; float32 (run on the PyTorch references) is eager fp32, the bound for the base's gradients."""
    cfg, K, L = model.config, model.config.num_heads, model.config.num_layers
    base_copy = copy.deepcopy(model.base).to(dtype)
    sd = {k: v.detach().to(dtype).requires_grad_() for k, v in model.heads.state_dict().items()}
    with torch.set_grad_enabled(model.stage == 2):
        hidden = base_copy.model(ids, position_ids=pos)  # (B, T, H)

    def mean_ce(logits, targets):  # mean over the non-ignored targets; 0 (not NaN) when there are none
        valid = targets != IGNORE
        if not valid.any():
            return logits.sum() * 0
        return F.cross_entropy(logits[valid], targets[valid])

    w0 = 1.0 if model.stage == 2 else 0.0  # the defaults: base CE on in stage 2 only
    base_ce = mean_ce(hidden @ base_copy.lm_head.weight.t(), _contract_targets(labels, 1, pos))
    loss = w0 * base_ce
    ces, top1, top5, counts = [], [], [], []
    for k in range(K):  # 0-based head k is docs/medusa.md's head k + 1: label t + k + 2, weight 0.2 * 0.8^(k+1)
        z = hidden
        for l in range(L):
            z = z + F.silu(z @ sd[f"{k}.{l}.linear.weight"].t() + sd[f"{k}.{l}.linear.bias"])
        w2 = base_copy.lm_head.weight.detach() if cfg.share_lm_head else sd[f"{k}.{L}.weight"]
        logits = z @ w2.t()  # (B, T, V), materialised
        targets = _contract_targets(labels, k + 2, pos)
        ce = mean_ce(logits, targets)
        loss = loss + 0.2 * 0.8 ** (k + 1) * sched * ce
        valid = targets != IGNORE
        # Rank = logits above the target's, plus those tied with it at a lower index (argmax's rule, the kernel's):
        # exact ties do occur here, since the pad token's embedding is zero, so at a document start its hidden state
        # and, with no ResBlock, every logit of a head are exactly 0.
        rows, want = logits[valid], targets[valid]
        tied_before = (rows == rows.gather(1, want[:, None])) & (torch.arange(rows.shape[1]) < want[:, None])
        rank = ((rows > rows.gather(1, want[:, None])) | tied_before).sum(-1)
        ces.append(ce.detach())
        top1.append(int((rank == 0).sum()))
        top5.append(int((rank < 5).sum()))
        counts.append(int(valid.sum()))
    loss.backward()
    base_grads = {n: p.grad for n, p in base_copy.named_parameters()} if model.stage == 2 else None
    return (loss.detach(), base_ce.detach() if w0 else None, torch.stack(ces), torch.tensor(top1), torch.tensor(top5),
            torch.tensor(counts), {n: t.grad for n, t in sd.items()}, base_grads)


def _check_materialised(model, ids, labels, pos, *, step=0, max_steps=1, sched=1.0):
    for p in model.heads.parameters():  # away from the zero init, so every gradient path carries signal
        p.data.add_(0.1 * torch.randn_like(p))
    loss, base_ce, ces, top1, top5, counts, head_grads, base_grads = _materialised_reference(
        model, ids, labels, pos, sched)
    eager_base_grads = None
    if base_grads is not None:  # through the whole base's attention backward, which fp32 itself gets to ~1e-5 only
        with reference_mode():
            eager_base_grads = _materialised_reference(model, ids, labels, pos, sched, torch.float32)[-1]
    out = model(ids, labels=labels, position_ids=pos, step=step, max_steps=max_steps)
    out.loss.backward()
    assert_matches(out.loss.detach(), loss, name="loss")
    assert_matches(out.head_losses, ces, name="head_losses")
    if base_ce is None:
        assert out.base_loss is None
    else:
        assert_matches(out.base_loss, base_ce, name="base_loss")
    assert out.head_count.tolist() == counts.tolist()
    assert out.head_top1.tolist() == top1.tolist() and out.head_top5.tolist() == top5.tolist()
    for name, p in model.heads.named_parameters():
        assert_matches(p.grad, head_grads[name], name=f"grad heads.{name}")
    for name, p in model.base.named_parameters():
        if base_grads is None:  # stage 1: nothing reaches the frozen base
            assert p.grad is None and not p.requires_grad, name
        else:
            assert_matches(p.grad, base_grads[name], eager=eager_base_grads[name], name=f"grad base.{name}")


@pytest.mark.parametrize("B,T", [(3, 12), (2, 3)])  # T=3 < K+1: the last heads have no target at all
@pytest.mark.parametrize("share,L", [(False, 0), (False, 1), (True, 1), (False, 2), (True, 2)])
@pytest.mark.parametrize("stage", [1, 2])
def test_matches_materialised_reference(stage, share, L, B, T):
    model = MedusaModel.from_base(make_base(V, H), stage=stage, num_heads=3, num_layers=L, share_lm_head=share)
    ids, labels, pos = _random_batch(B, T, packed=True)
    _check_materialised(model, ids, labels, pos)


@pytest.mark.parametrize("scheduler,step,max_steps,sched", [
    ("constant", 5, 8, 1.0), ("linear", 3, 8, 3 / 8), ("linear", 0, 8, 0.0), ("linear", 12, 8, 1.0),
    ("sine", 2, 8, math.sin(math.pi / 8)), ("sine_0.5", 1, 8, math.sin(math.pi / 2 * 0.25)),
    ("sine_0.5", 6, 8, 1.0),
])
@pytest.mark.parametrize("stage", [1, 2])
def test_schedules_match_materialised_reference(stage, scheduler, step, max_steps, sched):
    model = MedusaModel.from_base(make_base(V, H), stage=stage, num_heads=2, scheduler=scheduler)
    ids, labels, pos = _random_batch(2, 9, packed=True)
    _check_materialised(model, ids, labels, pos, step=step, max_steps=max_steps, sched=sched)


@pytest.mark.parametrize("share,L,T", [(False, 0, 3), (True, 2, 8)])
def test_materialised_reference_with_triton_interpreter(share, L, T, interpreted_kernels):
    """The same check through the real fused linear-CE kernel (interpreted): no ResBlocks with a short sequence, and
    two ResBlocks on the shared head."""
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=3, num_layers=L, share_lm_head=share)
    ids, labels, pos = _random_batch(2, T, packed=True)
    _check_materialised(model, ids, labels, pos)


def test_stage1_accumulation_with_uneven_micro_batches_matches_one_batch():
    """Per-term global counts (a plain list here) make micro-batches of 1 and 3 rows sum to the 4-row batch."""
    model = MedusaModel.from_base(make_base(V, H), stage=1, num_heads=3)
    for p in model.heads.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    ids, labels, pos = _random_batch(4, 10, packed=True)
    full = model(ids, labels=labels, position_ids=pos)
    full.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.heads.named_parameters()}
    model.zero_grad(set_to_none=True)
    counts = medusa_target_counts(labels, 3, pos).tolist()
    total = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 4)):
        out = model(ids[rows], labels=labels[rows], position_ids=pos[rows], normalizer=counts)
        out.loss.backward()
        total = total + out.loss.detach()
    assert_matches(total, full.loss.detach().double(), name="accumulated loss")
    for n, p in model.heads.named_parameters():
        assert_matches(p.grad, grads[n].double(), name=f"accumulated grad {n}")


def test_normalizer_one_element_tensor_and_wrong_lengths():
    """An all-reduced count shaped (1,) is one count for every term (it used to fail indexing at head 1); a per-term
    sequence of the wrong length (e.g. the heads' K counts without the base's) is refused, not silently shifted."""
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2)
    ids, labels, pos = _random_batch(2, 9, packed=True)
    scalar = model(ids, labels=labels, position_ids=pos, normalizer=40)
    one = model(ids, labels=labels, position_ids=pos, normalizer=torch.tensor([40]))
    assert_matches(one.loss.detach(), scalar.loss.detach().double(), name="(1,) normalizer")
    counts = medusa_target_counts(labels, 2, pos)
    for bad in (counts[1:], counts[1:].tolist(), [*counts.tolist(), 7], counts.view(1, 3)):
        with pytest.raises(ValueError, match="normalizer"):
            model(ids, labels=labels, position_ids=pos, normalizer=bad)


@pytest.mark.parametrize("field,value", [("heads_coefficient", math.nan), ("decay_coefficient", -0.8),
                                         ("base_loss_weight", math.inf), ("heads_coefficient", None)])
def test_config_refuses_loss_weights_that_are_not_finite_non_negative(field, value):
    """A NaN weight (from a hand-edited config.json) used to give a NaN loss with no error."""
    with pytest.raises(ValueError, match=field):
        MedusaConfig(num_heads=2, **{field: value})
    if value is not None:  # config.json's null means "the default"
        with pytest.raises(ValueError, match=field):
            MedusaConfig.from_json_dict({"medusa_num_heads": 2, f"medusa_{field}": value})


def test_tied_logits_are_not_top1_hits():
    """A head whose logits are all equal at a position (here: zero hidden states, no ResBlock) has learned nothing
    there, yet a strictly-above rank calls every such target top-1 and top-5 correct: a dead head would report 100%
    accuracy, the failure the per-head top-k metrics are meant to expose. Targets are ≥ 5, so the claim holds both
    for ties counted as misses and for torch.topk-style lowest-index-first tie-breaking."""
    base = make_base(V, H)
    heads = MedusaHeads(MedusaConfig.for_base(base, num_heads=2, num_layers=0), base.lm_head)
    hidden = torch.zeros(2, 6, H)
    labels = torch.randint(5, V, (2, 6))
    out = medusa_loss(hidden, heads, labels, head_scales=[1.0, 1.0])
    assert out.head_count.tolist() == [8, 6]
    assert out.head_top1.tolist() == [0, 0] and out.head_top5.tolist() == [0, 0]
