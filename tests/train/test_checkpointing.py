"""Checkpoints are atomic: a failure at any point of a save leaves the previous checkpoint and `latest` intact."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from liger_models import atomic
from liger_models.train import checkpointing as ckpt


def _writer(value: float):
    def write(directory, final):
        torch.save({"w": torch.full((3,), value)}, directory / "model.pt")

    return write


def _model_value(path) -> float:
    return float(torch.load(path / "model.pt", weights_only=True)["w"][0])


@pytest.mark.parametrize("fail_in", ["model", "state"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    root = tmp_path / "checkpoints"
    first = ckpt.save_checkpoint(root, 10, _writer(1.0), {"x": 1})
    assert ckpt.find_latest(root) == first and (root / "latest").read_text().strip() == "step_000010"

    def broken_model(directory, final):
        _writer(2.0)(directory, final)  # half of the files are written ...
        raise OSError("disk full")  # ... then the save dies

    write = broken_model if fail_in == "model" else _writer(2.0)
    if fail_in == "state":
        real_save = torch.save

        def failing_save(obj, f, *a, **k):
            if str(getattr(f, "name", f)).endswith(ckpt.STATE_FILE):  # a path or the file object saved into
                raise OSError("disk full")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(root, 20, write, {"x": 2})
    monkeypatch.undo()

    assert ckpt.find_latest(root) == first
    assert (root / "latest").read_text().strip() == "step_000010"
    assert _model_value(first) == 1.0 and ckpt.load_trainer_state(first) == {"x": 1, "step": 10}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000010"]  # no partial directory left


def test_hard_kill_leftovers_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    good = ckpt.save_checkpoint(root, 5, _writer(5.0), {})
    # A process killed mid-save leaves a temporary directory; one killed between rename and `latest` leaves a
    # complete directory that `latest` does not name yet; a stray step dir without state is incomplete.
    atomic.temp_path(root / "step_000006").mkdir()
    (root / "step_000007").mkdir()
    assert ckpt.find_latest(root) == good
    newer = ckpt.save_checkpoint(root, 8, _writer(8.0), {})
    (root / "latest").write_text("step_000099\n")  # names nothing valid: fall back to the highest complete step
    assert ckpt.find_latest(root) == newer


def test_a_resave_killed_between_its_renames_loses_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 4, _writer(4.0), {})
    # The re-save of step 4 renamed the old copy aside and died before renaming its new copy into place.
    os.rename(root / "step_000004", atomic.temp_path(root / "step_000004", "old"))
    atomic.temp_path(root / "step_000004").mkdir()
    latest = ckpt.find_latest(root)
    assert latest == root / "step_000004" and _model_value(latest) == 4.0


def test_resave_same_step_and_keep_last(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, step, _writer(float(step)), {}, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000002", "step_000003"]
    again = ckpt.save_checkpoint(root, 3, _writer(33.0), {}, keep_last=2)
    assert _model_value(again) == 33.0 and len(ckpt.list_checkpoints(root)) == 2


def test_keep_last_after_resuming_an_earlier_step(tmp_path):
    # Run A saved steps 2..4; run B resumed from step 2 and saves step 3 with keep_last=1: the checkpoint just
    # written must survive (and stay `latest`), run A's step 4 is not B's to prune.
    root = tmp_path / "checkpoints"
    for step in (2, 3, 4):
        ckpt.save_checkpoint(root, step, _writer(float(step)), {})
    again = ckpt.save_checkpoint(root, 3, _writer(33.0), {}, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000003", "step_000004"]
    assert ckpt.find_latest(root) == again and _model_value(again) == 33.0


def test_writer_learns_the_final_directory(tmp_path):
    seen = []
    path = ckpt.save_checkpoint(tmp_path, 7, lambda tmp, final: seen.append((tmp, final)), {})
    (tmp, final), = seen
    assert final == path and tmp != path and tmp.parent == path.parent and not tmp.exists()


def test_prune_cut_short_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A process killed while keep_last deletes an old checkpoint must not leave a step_N that lists as complete
    with its model files gone; the next save finishes the deletion."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, _writer(1.0), {})
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # the model file goes, then the process dies
        (Path(path) / "model.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 2, _writer(2.0), {}, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000002"]
    ckpt.save_checkpoint(root, 3, _writer(3.0), {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_resolve_resume_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve_resume(str(tmp_path), tmp_path)
    path = ckpt.save_checkpoint(tmp_path / "out" / "checkpoints", 4, _writer(4.0), {})
    assert ckpt.resolve_resume("auto", tmp_path / "out") == path
    assert ckpt.resolve_resume(str(path), tmp_path) == path
    assert ckpt.resolve_resume(str(path.parent), tmp_path) == path  # the checkpoints root
    assert ckpt.resolve_resume(str(tmp_path / "out"), tmp_path) == path  # an earlier run's --output-dir


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = (torch.rand(3), random.random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_resave_killed_while_deleting_the_old_copy(tmp_path, monkeypatch):
    """A re-save killed inside the old copy's deletion leaves a half-deleted ``.old`` beside the new step_N. It must
    go at the next save: kept, it held a checkpoint's worth of disk forever, and once step_N was pruned the next
    find_latest put it back as a step_N listed as complete without its model files."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 4, _writer(4.0), {})
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):  # the model file goes, trainer_state.pt is still there
        monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)  # the save's own clean-up then runs for real
        (Path(path) / "model.pt").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 4, _writer(44.0), {})
    assert _model_value(root / "step_000004") == 44.0 and len(_hidden(root)) == 1  # the new copy is in place

    ckpt.save_checkpoint(root, 5, _writer(5.0), {}, keep_last=1)  # prunes step 4
    assert _hidden(root) == []
    assert ckpt.find_latest(root) == root / "step_000005"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_000005"]


def test_next_save_deletes_what_hard_killed_saves_left(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, _writer(1.0), {})
    # Saves killed before their rename: a half-written checkpoint directory and a `latest` being replaced.
    partial = atomic.temp_path(root / "step_000002")
    partial.mkdir()
    torch.save({"w": torch.rand(1000)}, partial / "model.pt")
    atomic.temp_path(root / "latest").write_text("step_000002")
    assert ckpt.find_latest(root) == root / "step_000001" and partial.exists()  # a reader leaves them alone
    ckpt.save_checkpoint(root, 2, _writer(2.0), {})
    assert _hidden(root) == [] and _model_value(ckpt.find_latest(root)) == 2.0


def test_ranks_restoring_an_interrupted_resave_together(tmp_path, monkeypatch):
    """Every rank runs find_latest at startup: when another rank puts a re-save's ``.old`` back first, this one's
    rename finds nothing to move, which must not fail the run."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 3, _writer(3.0), {})
    os.rename(root / "step_000003", atomic.temp_path(root / "step_000003", "old"))
    real_rename = os.rename

    def other_rank_first(src, dst):
        monkeypatch.setattr(ckpt.os, "rename", real_rename)
        real_rename(src, dst)  # the other rank's rename, between this one's check and its own rename
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", other_rank_first)
    latest = ckpt.find_latest(root)
    assert latest == root / "step_000003" and _model_value(latest) == 3.0


def _write_bytes_checkpoint(root: Path, payload: bytes) -> Path:
    def write(directory, final):
        (directory / "blob.bin").write_bytes(payload)

    return ckpt.save_checkpoint(root, 1, write, {"step": 1})


def test_manifest_digest_is_sha256_over_piece_digests_and_catches_a_flip_in_any_piece(tmp_path, monkeypatch):
    """Each file's digest is SHA-256 over the SHA-256 of its consecutive PIECE_BYTES pieces (hashed side by side),
    so a flipped bit in any piece, the last partial one included, is found."""
    import hashlib
    import json

    monkeypatch.setattr(ckpt, "PIECE_BYTES", 1000)
    payload = bytes(random.getrandbits(8) for _ in range(3500))  # pieces of 1000, 1000, 1000, 500 bytes
    checkpoint = _write_bytes_checkpoint(tmp_path / "checkpoints", payload)
    manifest = json.loads((checkpoint / ckpt.MANIFEST_FILE).read_text())
    assert manifest["format"] == 2 and manifest["piece_bytes"] == 1000
    expected = hashlib.sha256(b"".join(hashlib.sha256(payload[i:i + 1000]).digest() for i in range(0, 3500, 1000)))
    assert manifest["files"]["blob.bin"]["pieces_sha256"] == expected.hexdigest()
    assert ckpt.damage(checkpoint) is None
    for offset in (random.randrange(0, 3000), random.randrange(3000, 3500)):
        flipped = bytearray(payload)
        flipped[offset] ^= 1 << random.randrange(8)
        (checkpoint / "blob.bin").write_bytes(bytes(flipped))
        assert ckpt.damage(checkpoint) == "blob.bin's SHA-256 differs from its manifest's (its bytes changed)"
    (checkpoint / "blob.bin").write_bytes(payload)
    monkeypatch.setattr(ckpt, "PIECE_BYTES", 64)  # the manifest's own piece size is what verification uses
    assert ckpt.damage(checkpoint) is None


def test_a_format_1_manifest_of_whole_file_digests_still_verifies(tmp_path):
    """Checkpoints written before piece digests carry each file's plain SHA-256: still checked, flips still found."""
    import json

    payload = os.urandom(2000)
    checkpoint = _write_bytes_checkpoint(tmp_path / "checkpoints", payload)
    files = sorted(p for p in checkpoint.iterdir() if p.name != ckpt.MANIFEST_FILE)
    old = {"format": 1, "files": {p.name: {"size": p.stat().st_size, "sha256": ckpt.file_sha256(p)} for p in files}}
    (checkpoint / ckpt.MANIFEST_FILE).write_text(json.dumps(old))
    assert ckpt.damage(checkpoint) is None
    (checkpoint / "blob.bin").write_bytes(payload[:-1] + bytes([payload[-1] ^ 4]))
    assert ckpt.damage(checkpoint) == "blob.bin's SHA-256 differs from its manifest's (its bytes changed)"
