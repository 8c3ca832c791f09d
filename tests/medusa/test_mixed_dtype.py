"""Heads kept in another dtype than the base (fp32 heads on a bf16 base), which `MedusaModel.from_pretrained(...,
base=, dtype=)` and `MedusaHeads(..., dtype=)` allow: loss, metrics and gradients vs the float64 reference."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from liger_models.medusa import MedusaConfig, MedusaHeads, MedusaModel, medusa_loss
from tests.helpers import assert_matches, rel_l2
from tests.medusa._common import float64_copies, make_base, packed_batch, reference_loss

V, H = 37, 16


def _fp32_heads_on_bf16_base(share: bool) -> MedusaModel:
    base = make_base(V, H, torch.bfloat16)
    config = MedusaConfig.for_base(base, num_heads=3, share_lm_head=share)
    heads = MedusaHeads(config, base.lm_head, dtype=torch.float32)
    for p in heads.parameters():  # away from the zero init, so every gradient path carries signal
        p.data.add_(0.1 * torch.randn_like(p))
    return MedusaModel(base, heads, stage=1)


@pytest.mark.parametrize("share", [False, True])
def test_fp32_heads_on_bf16_hidden_match_float64(share):
    """The heads' part on fixed bf16 hidden states (a leaf, as stage 2 backpropagates into the base).

    Own projection: everything after the bf16 hidden states is fp32, so fp32 tolerances hold. Shared bf16 lm_head:
    the logits are a bf16 GEMM, so bf16's 1e-2 (rel L2) applies to what depends on them."""
    model = _fp32_heads_on_bf16_base(share)
    ids, labels, pos = packed_batch(2, 11, V, packed=True)
    with torch.no_grad():
        hidden = model.base.model(ids, position_ids=pos)
    hidden = hidden.requires_grad_()
    scales = model.head_scales()
    out = medusa_loss(hidden, model.heads, labels, position_ids=pos, head_scales=scales)
    out.loss.backward()

    base64, sd64 = float64_copies(model.base, model.heads)
    hidden64 = hidden.detach().double().requires_grad_()
    ref_base = SimpleNamespace(model=lambda *args, **kwargs: hidden64, lm_head=base64.lm_head)
    ref_loss, _, ref_ces, ref_top1, ref_top5, ref_count = reference_loss(
        ref_base, sd64, model.config, ids, labels, pos, w0=0.0, scales=scales, stage=2)
    ref_loss.backward()

    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert torch.equal(out.head_count, ref_count)
    checks = {"loss": (out.loss, ref_loss), "head_losses": (out.head_losses, ref_ces),
              "grad hidden": (hidden.grad, hidden64.grad)}
    for name, p in model.heads.named_parameters():
        assert p.dtype == torch.float32, name
        checks[f"grad heads.{name}"] = (p.grad, sd64[name].grad)
    for name, (ours, ref) in checks.items():
        if share or name == "grad hidden":  # through a bf16 GEMM (shared logits, or dL/dh cast to bf16)
            assert rel_l2(ours, ref) <= 1e-2, f"{name}: rel L2 {rel_l2(ours, ref):.3e}"
        else:
            assert_matches(ours.float(), ref.detach(), name=name)
    if not share:  # fp32 logits: the ranks are the reference's
        assert torch.equal(out.head_top1, ref_top1) and torch.equal(out.head_top5, ref_top5)


@pytest.mark.parametrize("share", [False, True])
def test_from_pretrained_fp32_heads_on_bf16_base_trains_and_decodes(tmp_path, share):
    """The user-facing path: bf16 heads saved, reloaded as fp32 beside the same bf16 base (stage 1 and stage 2)."""
    base = make_base(V, H, torch.bfloat16)
    MedusaModel.from_base(base, num_heads=2, share_lm_head=share).save_pretrained(str(tmp_path))
    ids, labels, pos = packed_batch(2, 9, V, packed=True)
    for stage in (1, 2):
        model = MedusaModel.from_pretrained(str(tmp_path), base=base, dtype=torch.float32, stage=stage)
        assert all(p.dtype == torch.float32 for p in model.heads.parameters())
        out = model(ids, labels=labels, position_ids=pos)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(out.head_losses).all()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.heads.parameters())
        if stage == 2:
            assert model.base.model.layers[0].mlp.down_proj.weight.grad is not None
        with torch.no_grad():
            logits = model(ids).head_logits
        assert logits.shape == (2, 2, 9, V) and torch.isfinite(logits).all()
        base.zero_grad(set_to_none=True)


@pytest.mark.parametrize("share,stage", [(False, 2), (True, 1)])
def test_autocast_over_float32_model_trains(monkeypatch, share, stage):
    """AMP the usual way: float32 base and heads under torch.autocast. The ResBlocks' GEMMs come out in bf16 while
    the lm_heads stay float32; the loss runs each head's GEMM in autocast's dtype (as nn.Linear would: not a float32
    V×H GEMM per head), and every trained parameter gets its float32 gradient."""
    import liger_models.medusa.loss as loss_mod

    dtypes = []
    fused = loss_mod.fused_linear_cross_entropy
    monkeypatch.setattr(loss_mod, "fused_linear_cross_entropy",
                        lambda h, w, *a, **k: (dtypes.append((h.dtype, w.dtype)), fused(h, w, *a, **k))[1])
    base = make_base(V, H, torch.float32)
    config = MedusaConfig.for_base(base, num_heads=3, share_lm_head=share)
    heads = MedusaHeads(config, base.lm_head)
    for p in heads.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    model = MedusaModel(base, heads, stage=stage)
    ids, labels, pos = packed_batch(2, 11, V, packed=True)
    exact = model(ids, labels, pos).loss.item()
    dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels, pos)
    out.loss.backward()
    assert dtypes and set(dtypes) == {(torch.bfloat16, torch.bfloat16)}
    assert out.loss.dtype == torch.float32 and abs(out.loss.item() - exact) <= 2e-2 * abs(exact)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name


def test_fp32_heads_inference_logits_on_bf16_base():
    """Inference: own-projection fp32 heads turn the base's bf16 hidden states into fp32 logits that match a float64
    materialised reference on those same hidden states to fp32 precision; the base logits stay the base's bf16."""
    model = _fp32_heads_on_bf16_base(share=False)
    ids, _, pos = packed_batch(2, 7, V, packed=True)
    with torch.no_grad():
        out = model(ids, position_ids=pos)
        hidden64 = model.base.model(ids, position_ids=pos).double()
    assert out.logits.dtype == torch.bfloat16 and out.head_logits.dtype == torch.float32
    sd64 = {k: v.double() for k, v in model.heads.state_dict().items()}
    for k in range(3):
        z = hidden64 + F.silu(hidden64 @ sd64[f"{k}.0.linear.weight"].t() + sd64[f"{k}.0.linear.bias"])
        assert_matches(out.head_logits[k], z @ sd64[f"{k}.1.weight"].t(), name=f"head {k} logits")
