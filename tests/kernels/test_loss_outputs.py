"""The loss options trainers log or set: class weights, the z-loss term as its own output, token accuracy, the
predicted tokens, token scaling (TRL's DFT loss).

Both losses (cross_entropy on logits, fused_linear_cross_entropy on hidden states) against a float64 PyTorch
reference: torch's F.cross_entropy(weight=...) for class weights, lse² for z-loss, argmax for accuracy and the
predictions, TRL's dft_loss formula for token scaling. Fresh random inputs, ignored labels, odd sizes; the kernels'
path (the interpreter on CPU) and the PyTorch path (reference_mode).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from liger_models import reference_mode
from liger_models.kernels.ops.cross_entropy import cross_entropy
from liger_models.kernels.ops.fused_linear_cross_entropy import LossOutput, fused_linear_cross_entropy

from ..helpers import DEVICE

N, H, V = 37, 24, 53
PATHS = {"kernel": contextlib.nullcontext, "reference": reference_mode}


def _inputs(seed_shift: int = 0):
    hidden = torch.randn(N, H, dtype=torch.float32, device=DEVICE)
    weight = torch.randn(V, H, dtype=torch.float32, device=DEVICE) * 0.3
    labels = torch.randint(0, V, (N,), device=DEVICE)
    labels[::5] = -100
    class_weights = torch.rand(V, device=DEVICE) + 0.1
    return hidden, weight, labels, class_weights


def _reference(logits64, labels, *, reduction, class_weights=None, z_loss=0.0, normalizer=None, dft=False,
               smoothing=0.0):
    """float64: Σ_t [w_t ((1−ε)·CE_t + z·lse_t²) + ε/V·Σ_j w_j (lse_t − x_tj)] / Σ_t w_t (mean), over non-ignored t;
    torch's weighted CE (with label smoothing ε) when z = 0. dft: each token's term times p_t = exp(−CE_t), detached
    (TRL's dft_loss: −exp(logp).detach()·logp), the denominator unchanged."""
    valid = labels != -100
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits64, -1)
    logp = logits64.gather(-1, target[:, None])[:, 0] - lse
    per_token = -(1 - smoothing) * logp + z_loss * lse.square()
    cw = torch.ones_like(logits64[0]) if class_weights is None else class_weights.double()
    w = torch.where(valid, cw[target], 0.0)
    per_token = per_token * w + smoothing / logits64.shape[-1] * ((lse[:, None] - logits64) * cw).sum(-1)
    per_token = torch.where(valid, per_token, 0.0)
    if dft:
        per_token = per_token * logp.exp().detach()
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (w.sum() if normalizer is None else normalizer)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_class_weights_match_torch_weighted_cross_entropy(path, reduction, z_loss):
    hidden, weight, labels, class_weights = _inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with PATHS[path]():
        loss = fused_linear_cross_entropy(h, w, labels, reduction=reduction, z_loss=z_loss,
                                          class_weights=class_weights)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference(h64 @ w64.T, labels, reduction=reduction, class_weights=class_weights, z_loss=z_loss)
    if z_loss == 0.0 and reduction != "none":  # the oracle itself agrees with torch's own weighted CE
        torch_ref = F.cross_entropy((h64 @ w64.T).detach(), labels, weight=class_weights.double(),
                                    reduction=reduction, ignore_index=-100)
        torch.testing.assert_close(ref.detach(), torch_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    upstream = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fused", [True, False], ids=["linear-CE", "CE"])
@pytest.mark.parametrize("reduction, extra", [(r, e) for r in ("mean", "sum", "none") for e in ("plain", "z-loss", "dft")]
                         + [("mean", "normalizer")])
def test_class_weights_with_label_smoothing_match_torch(path, fused, reduction, extra):
    """torch's F.cross_entropy(weight=w, label_smoothing=ε): the smoothing term weighs every class, ε/V·Σ_j w_j·(lse −
    x_j), and is not scaled by the target's weight; the mean divides by Σ w_t. A target of weight 0 keeps its
    smoothing term. With z-loss (its term weighed by w_t, and returned), token scaling (the whole token term times
    p_t) or a normaliser."""
    hidden, weight, labels, class_weights = _inputs()
    class_weights[labels[1]] = 0.0  # labels[1] is not ignored (every fifth is)
    eps, z = 0.15, (1e-3 if extra == "z-loss" else 0.0)
    normalizer = 29.0 if extra == "normalizer" else None
    opts = dict(reduction=reduction, class_weights=class_weights, label_smoothing=eps, z_loss=z,
                use_token_scaling=extra == "dft", normalizer=normalizer, return_z_loss=True)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with PATHS[path]():
        out = (fused_linear_cross_entropy(h, w, labels, **opts) if fused
               else cross_entropy(h @ w.T, labels, **opts))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference(h64 @ w64.T, labels, reduction=reduction, class_weights=class_weights, z_loss=z,
                     dft=extra == "dft", smoothing=eps, normalizer=normalizer)
    if extra == "plain":  # the oracle is torch's own weighted, smoothed cross-entropy
        torch_ref = F.cross_entropy((h64 @ w64.T).detach(), labels, weight=class_weights.double(),
                                    label_smoothing=eps, reduction=reduction, ignore_index=-100)
        torch.testing.assert_close(ref.detach(), torch_ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    z_ref = _reference(h64.detach() @ w64.detach().T, labels, reduction=reduction, class_weights=class_weights,
                       z_loss=z, dft=extra == "dft", normalizer=normalizer) - _reference(
        h64.detach() @ w64.detach().T, labels, reduction=reduction, class_weights=class_weights,
        dft=extra == "dft", normalizer=normalizer)
    torch.testing.assert_close(out.z_loss.double(), z_ref, rtol=2e-5, atol=1e-7)
    upstream = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (out.loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("path", list(PATHS))
def test_class_weights_on_logits_with_a_normalizer(path):
    _, _, labels, class_weights = _inputs()
    logits = torch.randn(N, V, device=DEVICE)
    x = logits.clone().requires_grad_()
    with PATHS[path]():
        loss = cross_entropy(x, labels, class_weights=class_weights, normalizer=11.0)
    x64 = logits.double().requires_grad_()
    ref = _reference(x64, labels, reduction="mean", class_weights=class_weights, normalizer=11.0)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-4, atol=2e-7)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fused", [True, False], ids=["linear-CE", "CE"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss_and_token_accuracy_outputs(path, fused, reduction):
    hidden, weight, labels, _ = _inputs()
    logits64 = hidden.double() @ weight.double().T
    # Ties for the argmax: a row whose target shares the maximum with a lower column is not top-1.
    logits64[1] = 0.0
    labels[1] = 3
    logits = logits64.float()
    z_coef = 2e-3

    def call(**kw):
        with PATHS[path]():
            if fused:
                eye = torch.eye(V, device=DEVICE)  # logits · Iᵀ: the fused op on logits the test knows
                return fused_linear_cross_entropy(logits, eye, labels, reduction=reduction, z_loss=z_coef, **kw)
            return cross_entropy(logits.clone(), labels, reduction=reduction, z_loss=z_coef, **kw)

    plain = call()
    out = call(return_z_loss=True, return_token_accuracy=True)
    assert isinstance(out, LossOutput) and out.target_rank is None
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=0)  # asking for more leaves the loss as it was
    valid = labels != -100
    lse = torch.logsumexp(logits64, -1)
    z_rows = torch.where(valid, z_coef * lse.square(), 0.0)
    z_ref = z_rows if reduction == "none" else z_rows.sum() / valid.sum()
    torch.testing.assert_close(out.z_loss.double(), z_ref, rtol=2e-5, atol=1e-7)
    top1 = (logits64.argmax(-1) == labels) & valid
    assert not top1[1]
    torch.testing.assert_close(out.token_accuracy.double(), top1.sum().double() / valid.sum(), rtol=0, atol=1e-7)
    assert not out.z_loss.requires_grad and not out.token_accuracy.requires_grad


@pytest.mark.parametrize("path", list(PATHS))
def test_z_loss_output_is_zero_without_z_loss_and_rank_rides_along(path):
    hidden, weight, labels, _ = _inputs()
    with PATHS[path]():
        out = fused_linear_cross_entropy(hidden, weight, labels, return_z_loss=True, return_target_rank=True)
    assert out.z_loss.item() == 0.0 and out.token_accuracy is None
    assert out.target_rank.shape == labels.shape and bool((out.target_rank[labels == -100] == -1).all())


def test_every_label_ignored_gives_zero_accuracy_and_loss():
    hidden, weight, labels, class_weights = _inputs()
    labels[:] = -100
    out = fused_linear_cross_entropy(hidden, weight, labels, class_weights=class_weights,
                                     return_token_accuracy=True, return_z_loss=True, z_loss=1e-3)
    assert out.loss.item() == 0.0 and out.token_accuracy.item() == 0.0 and out.z_loss.item() == 0.0


def test_bad_class_weights_are_refused():
    hidden, weight, labels, class_weights = _inputs()
    with pytest.raises(ValueError, match=r"class_weights must be a \(53,\) tensor"):
        fused_linear_cross_entropy(hidden, weight, labels, class_weights=class_weights[:-1])
    with pytest.raises(ValueError, match="floating point"):
        cross_entropy(hidden @ weight.T, labels, class_weights=torch.ones(V, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction, smoothing", [("mean", 0.0), ("none", 0.0), ("mean", 0.1), ("none", 0.1)])
def test_gpu_real_size_class_weights_and_outputs(reduction, smoothing):
    """4096 tokens × 128256 columns in bf16 (two chunks in grad_W's storage) against the fp32 PyTorch path on the
    same bf16 values, and eager PyTorch in bf16 for the gradients' error budget; with label smoothing the compiled
    kernel reads the class weights in both passes."""
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_reference

    from ..helpers import assert_matches, rel_l2

    n, hdim, vocab = 4096, 2048, 128256
    hidden = (torch.randn(n, hdim, device="cuda") / 2).to(torch.bfloat16)
    weight = (torch.randn(vocab, hdim, device="cuda") / hdim**0.5 * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::11] = -100
    class_weights = torch.rand(vocab, device="cuda") + 0.5
    opts = dict(class_weights=class_weights, z_loss=1e-4, reduction=reduction, label_smoothing=smoothing)
    upstream = torch.randn(n, device="cuda") if reduction == "none" else torch.tensor(1.0, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_linear_cross_entropy(h, w, labels, return_z_loss=True, return_token_accuracy=True, **opts)
    (out.loss * upstream).sum().backward()
    hf, wf = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = fused_linear_cross_entropy_reference(hf, wf, labels, return_z_loss=True, return_token_accuracy=True,
                                               **opts)
    (ref.loss * upstream).sum().backward()
    he, we = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    eager = fused_linear_cross_entropy_reference(he, we, labels, **opts)
    (eager * upstream).sum().backward()
    # Losses of bf16 logits (HF's numerics) are as far from the fp32-logit ones as that rounding makes them, which
    # per token is up to |z|·2⁻⁹: within 2× eager PyTorch's error on the same bf16 inputs.
    ref_loss = ref.loss.detach().double()
    if reduction == "none":
        assert rel_l2(out.loss, ref_loss) <= 2 * rel_l2(eager.detach(), ref_loss) + 1e-6
    else:  # the mean of 3.7k such errors
        torch.testing.assert_close(out.loss.double(), ref_loss, rtol=2e-3, atol=0)
    torch.testing.assert_close(out.z_loss, ref.z_loss, rtol=2e-3, atol=1e-6)
    # Accuracy over bf16 logits: a near-tied argmax may flip between bf16 and fp32 logits, a few tokens at most
    assert abs(out.token_accuracy.item() - ref.token_accuracy.item()) <= 4 / n
    assert_matches(h.grad, hf.grad.double(), eager=he.grad, name="dh")
    assert_matches(w.grad, wf.grad.double(), eager=we.grad, name="dW")


def test_loss_output_keeps_its_field_positions():
    """predicted_tokens is the last field: the four before it keep their positions (out[1] is still the z-loss)."""
    assert LossOutput._fields == ("loss", "z_loss", "token_accuracy", "target_rank", "predicted_tokens")
    out = LossOutput(torch.tensor(1.0))
    assert len(out) == 5 and out[1:] == (None,) * 4


def _call(fused, logits, labels, **kw):
    """Either loss on these exact logits: the fused op as logits · Iᵀ (exact in fp32)."""
    if fused:
        return fused_linear_cross_entropy(logits, torch.eye(logits.shape[-1], device=DEVICE), labels, **kw)
    return cross_entropy(logits.clone(), labels, **kw)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fused", [True, False], ids=["linear-CE", "CE"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_token_scaling_is_trl_dft_loss(path, fused, reduction, weighted):
    """use_token_scaling: TRL's DFT per-token loss −p_t·log p_t with p_t detached (times the class weight, with the
    z-loss term scaled by p_t too), the mean divided by the usual denominator; its gradient p_t·dCE_t/dx."""
    hidden, weight, labels, class_weights = _inputs()
    class_weights = class_weights if weighted else None
    z_coef = 1e-3
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with PATHS[path]():
        if fused:
            out = fused_linear_cross_entropy(h, w, labels, reduction=reduction, z_loss=z_coef,
                                             class_weights=class_weights, use_token_scaling=True, return_z_loss=True)
        else:
            out = cross_entropy(h @ w.T, labels, reduction=reduction, z_loss=z_coef, class_weights=class_weights,
                                use_token_scaling=True, return_z_loss=True)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _reference(h64 @ w64.T, labels, reduction=reduction, class_weights=class_weights, z_loss=z_coef, dft=True)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    with torch.no_grad():  # the z-loss term, scaled as the loss is
        z_only = _reference(h64 @ w64.T, labels, reduction=reduction, class_weights=class_weights, z_loss=z_coef,
                            dft=True) - _reference(h64 @ w64.T, labels, reduction=reduction,
                                                   class_weights=class_weights, dft=True)
    torch.testing.assert_close(out.z_loss.double(), z_only, rtol=2e-5, atol=1e-8)
    upstream = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (out.loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fused", [True, False], ids=["linear-CE", "CE"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_predicted_tokens(path, fused, reduction):
    """int64 argmax per token in labels' shape, -1 where ignored, ties to the lowest index (a row of equal logits
    predicts 0; a row whose maximum sits in two columns predicts the first), the loss as without them."""
    hidden, weight, labels, _ = _inputs()
    logits64 = hidden.double() @ weight.double().T
    logits64[1] = 0.0  # all tied
    logits64[2, 7] = logits64[2, 40] = logits64[2].max() + 1  # tied maximum at columns 7 and 40
    labels[1], labels[2] = 3, 40
    logits = logits64.float()
    with PATHS[path]():
        plain = _call(fused, logits, labels, reduction=reduction)
        out = _call(fused, logits, labels, reduction=reduction, return_predicted_tokens=True)
    assert isinstance(out, LossOutput) and out.z_loss is None and out.token_accuracy is None
    torch.testing.assert_close(out.loss, plain, rtol=0, atol=0)
    predicted = out.predicted_tokens
    assert predicted.dtype == torch.int64 and predicted.shape == labels.shape and not predicted.requires_grad
    valid = labels != -100
    assert torch.equal(predicted[~valid], torch.full_like(predicted[~valid], -1))
    assert predicted[1] == 0 and predicted[2] == 7
    top2 = logits64.topk(2, -1).values
    clear = valid & (top2[:, 0] - top2[:, 1] > 1e-5 * logits64.abs().amax(-1))  # beyond fp32's rounding
    assert clear.sum() >= valid.sum() - 4
    assert torch.equal(predicted[clear], logits64.argmax(-1)[clear])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fused", [True, False], ids=["linear-CE", "CE"])
def test_predicted_tokens_are_the_argmax_of_the_capped_logits(path, fused):
    """With a softcap the prediction is the argmax of c·tanh(x/c) in fp32 (Liger-Kernel's convention): logits far
    past the cap saturate to the same capped value, and the lowest such index wins even where a later raw logit is
    larger; below saturation the cap is monotonic and changes nothing."""
    hidden, weight, labels, _ = _inputs()
    logits = (hidden @ weight.T) * 0.2
    logits[1, 5], logits[1, 30] = 40.0, 90.0  # tanh(40) and tanh(90) are both 1.0 in fp32 at c = 1
    labels[1] = 30  # the larger raw logit: ranked behind column 5, as the prediction says
    with PATHS[path]():
        out = _call(fused, logits, labels, softcap=1.0, return_predicted_tokens=True, return_token_accuracy=True)
    capped = torch.tanh(logits)
    assert capped[1, 5] == capped[1, 30] and logits[1].argmax() == 30
    want = torch.where(labels != -100, capped.argmax(-1), -1)
    assert want[1] == 5
    assert torch.equal(out.predicted_tokens, want)
    valid = labels != -100
    torch.testing.assert_close(out.token_accuracy.double(),  # top-1 as the predictions count it
                               (out.predicted_tokens == labels)[valid].double().mean(), rtol=0, atol=1e-7)
