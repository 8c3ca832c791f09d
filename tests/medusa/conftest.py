"""TEMPORARY: contract stand-ins for dependencies that have not landed yet (removed once they exist)."""

import sys
import types

import torch
import torch.nn.functional as F


def _flce(hidden, weight, labels, bias=None, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
          reduction="mean", normalizer=None, loss_scale=1.0, accum_dtype=torch.float32, return_target_rank=False):
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    logits = (h @ weight.t()).float()
    per = F.cross_entropy(logits, y.clamp(min=0), reduction="none") * (y != ignore_index)
    if reduction == "mean":
        loss = per.sum() / (normalizer if normalizer is not None else (y != ignore_index).sum())
    else:
        loss = per.sum()
    loss = loss * loss_scale
    if not return_target_rank:
        return loss
    with torch.no_grad():
        tgt = logits.gather(1, y.clamp(min=0)[:, None])
        rank = (logits > tgt).sum(1).to(torch.int32)
        rank[y == ignore_index] = -1
    return loss, rank


def _shift_labels(labels, shift, position_ids=None, ignore_index=-100):
    B, T = labels.shape
    out = torch.full_like(labels, ignore_index)
    if shift < T:
        out[:, : T - shift] = labels[:, shift:]
        if position_ids is not None:
            pid = position_ids.expand(B, T)
            ok = pid[:, shift:] == pid[:, : T - shift] + shift
            out[:, : T - shift][~ok] = ignore_index
    return out


try:
    import liger_models.kernels.fused_linear_cross_entropy  # noqa: F401
except ImportError:
    m = types.ModuleType("liger_models.kernels.fused_linear_cross_entropy")
    m.fused_linear_cross_entropy = _flce
    sys.modules[m.__name__] = m
import liger_models.modules as _mods

if not hasattr(_mods, "shift_labels"):
    _mods.shift_labels = _shift_labels
