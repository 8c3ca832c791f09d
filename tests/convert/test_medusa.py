"""Medusa heads saved as a vLLM export (liger_models/medusa/vllm_format.py) or in format B
(liger_models/medusa/checkpoint.py): a failed save leaves the previous one as it was."""

from __future__ import annotations

import os

import pytest
import torch

import liger_models.medusa.vllm_format as vllm_export
import liger_models.medusa.checkpoint as format_b
from liger_models.convert.medusa import load_vllm, save_vllm
from liger_models.medusa import MedusaModel
from liger_models.medusa.checkpoint import load_heads, save_heads
from tests.medusa._common import make_base

V, H = 37, 16


def _heads(share: bool, K: int):
    model = MedusaModel.from_base(make_base(V, H), stage=1, num_heads=K, num_layers=1, share_lm_head=share)
    for p in model.heads.parameters():
        p.data.normal_()
    return model.heads


def _files(directory) -> dict[str, bytes]:
    return {p: (directory / p).read_bytes() for p in os.listdir(directory)}


SAVERS = {"vllm": (save_vllm, load_vllm, vllm_export), "format B": (save_heads, load_heads, format_b)}


@pytest.mark.parametrize("saver", list(SAVERS))
@pytest.mark.parametrize("failing", ["config", "weights"])
def test_failed_save_keeps_the_previous_one(tmp_path, monkeypatch, failing, saver):
    # The second save changes the layout (own lm_heads → shared, 3 → 2 heads): new weights under the old
    # config.json would be another model, or none that loads.
    save, load, module = SAVERS[saver]
    first = _heads(False, 3)
    save(first, str(tmp_path))
    before = _files(tmp_path)

    def crash(path, *args, **kwargs):  # a full disk in the middle of one of the two writes
        if failing == "weights":  # (save_json is atomic on its own: its failure changes no file)
            with open(path, "wb") as f:
                f.write(b"partial")
        raise OSError("disk full")

    if failing == "config":
        monkeypatch.setattr(module, "save_json", crash)
    else:
        monkeypatch.setattr(format_b, "save_file", lambda data, path, metadata=None: crash(path))
    with pytest.raises(OSError, match="disk full"):
        save(_heads(True, 2), str(tmp_path))
    assert _files(tmp_path) == before  # both files as they were, and no temporary file left
    monkeypatch.undo()
    again = load(str(tmp_path))
    x = torch.randn(5, H)
    for got, want in zip(again.logits(x), first.logits(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
