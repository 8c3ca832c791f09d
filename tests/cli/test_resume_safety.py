"""A resume continues the run its checkpoint belongs to, or says why not, through the real CLI on a tiny model (CPU).

Changed settings (base weights, data, batch size, accumulation, dtype, seed) are refused, each named, unless
--allow-changed-settings lets them through, logged. A damaged newest checkpoint (trainer_state.pt or the heads file
emptied, cut short, a bit flipped, missing) is passed over with a warning for the one before it, and the run then
ends bit for bit where an undamaged one ends. A full disk (a small tmpfs where this machine can mount one; an ENOSPC
injected into the writers always) ends the run with one line, exit status 2, the previous checkpoint intact and no
temporaries left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.cli import main
from liger_models.train import checkpointing as ckpt
from liger_models.train.run_dir import LOCK_FILE

pytestmark = pytest.mark.usefixtures("reference_path")

HEADS = "medusa_lm_head.safetensors"
STEPS = 4  # the runs below checkpoint at steps 2 and 4
RUN = ["--seq-len", "32", "--batch-size", "2", "--save-every", "2", "--keep-last", "2", "--num-heads", "2",
       "--lr", "3e-3", "--warmup-steps", "1", "--device", "cpu", "--dtype", "fp32", "--quiet"]


def _medusa(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train-medusa", "--model", str(model), "--data", str(data), "--output-dir", str(out), *RUN, *extra]


def _code_and_error(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / ckpt.step_dir_name(step)


@pytest.fixture(scope="module")
def run(tiny_model_dir, text_file, tmp_path_factory):
    """A finished STEPS-step Medusa stage-1 run on its own copies of the base and the data, and the bytes of its
    last heads file (what a resumed run must end with, bit for bit)."""
    root = tmp_path_factory.mktemp("resume_safety")
    model, data, out = root / "base", root / "data.txt", root / "run"
    shutil.copytree(tiny_model_dir, model)
    shutil.copy(text_file, data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        assert main(_medusa(model, data, out, "--max-steps", str(STEPS))) == 0
    return model, data, out, (_step(out, STEPS) / HEADS).read_bytes()


@pytest.fixture
def copy(run, tmp_path):
    """(base, data, a copy of the run's directory): the base and the data are the run's own."""
    model, data, out, _ = run
    mine = tmp_path / "run"
    shutil.copytree(out, mine)
    return model, data, mine


def _other_weights(model: Path, into: Path) -> Path:
    """``into`` holds a model of ``model``'s shapes and tokenizer with other weights (seeded)."""
    if into != model:
        shutil.copytree(model, into)
    torch.manual_seed(1)
    other = AutoLigerForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.02)
    other.save_pretrained(into)
    return into


# --------------------------------------------------------------------------------------------- changed settings


def _one_character_edited(data: Path, into: Path) -> Path:
    text = data.read_text()
    i = text.index("the")
    into.write_text(text[:i] + "thE" + text[i + 3:])  # same length, same window count
    return into


CHANGES = {  # name: (how the resume's argv changes, what the refusal says)
    "model": (lambda m, d, tmp: ["--model", str(_other_weights(m, tmp / "B2"))],
              r"model \S+/base → \S+/B2; model-weights [0-9a-f]{12} → [0-9a-f]{12}\."),
    "model-weights": (lambda m, d, tmp: ["--model", str(_other_weights(m, m))],
                      r"model-weights [0-9a-f]{12} → [0-9a-f]{12}\."),
    "data": (lambda m, d, tmp: ["--data", str(_one_character_edited(d, tmp / "edited.txt"))],
             r"data \[[0-9a-f]{12}\] → \[[0-9a-f]{12}\]"),
    "batch-size": (lambda m, d, tmp: ["--batch-size", "4"], r"batch-size 2 → 4"),
    "grad-accum": (lambda m, d, tmp: ["--grad-accum", "2"], r"grad-accum 1 → 2"),
    "dtype": (lambda m, d, tmp: ["--dtype", "bf16"], r"dtype fp32 → bf16"),
    "seed": (lambda m, d, tmp: ["--seed", "7"], r"seed 0 → 7"),
    "adam-eps": (lambda m, d, tmp: ["--adam-eps", "1e-6"], r"adam-eps 1e-08 → 1e-06"),
}


@pytest.mark.parametrize("name", CHANGES)
def test_a_resume_with_changed_settings_is_refused_naming_each(name, run, copy, tmp_path, capsys):
    model, data, out = copy
    weights = (model / "model.safetensors").read_bytes()  # the model-weights case changes them in place
    try:
        change, said = CHANGES[name]
        argv = [*_medusa(model, data, out, "--max-steps", str(STEPS + 1), "--resume", "auto"),
                *change(model, data, tmp_path)]
        before = sorted(p.name for p in (out / "checkpoints").iterdir())
        code, err = _code_and_error(argv, capsys)
    finally:
        (model / "model.safetensors").write_bytes(weights)
    assert code == 2 and "Traceback" not in err, err
    assert re.search(f"was trained with other settings: {said}", err), err
    assert f"--allow-changed-settings {name}" in err.replace(",model-weights", "")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing trained, nothing written


def test_allowed_changes_go_through_logged_and_become_the_runs(copy, tmp_path, capsys):
    model, data, out = copy
    b2 = _other_weights(model, tmp_path / "B2")
    code, err = _code_and_error([*_medusa(b2, data, out, "--max-steps", "5", "--batch-size", "4", "--seed", "7",
                                          "--resume", "auto", "--allow-changed-settings",
                                          "model,model-weights,batch-size,seed")], capsys)
    assert code == 0, err
    assert re.search(r"with changed settings \(--allow-changed-settings\): model \S+ → \S+/B2; model-weights "
                     r"[0-9a-f]{12} → [0-9a-f]{12}; batch-size 2 → 4; seed 0 → 7$", err, re.M), err
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["step"] == 5 and {k: v for k, v in logged["settings_changed"].items()
                                    if k in ("batch-size", "seed")} == {"batch-size": [2, 4], "seed": [0, 7]}
    assert set(logged["settings_changed"]) == {"model", "model-weights", "batch-size", "seed"}
    assert json.loads((_step(out, 5) / "config.json").read_text())["base_model_name_or_path"] == str(b2)
    # The new settings are the run's now: continued with them (and a longer --max-steps) needs no flag ...
    assert main(_medusa(b2, data, out, "--max-steps", "6", "--batch-size", "4", "--seed", "7", "--resume",
                        "auto")) == 0
    # ... and the old ones are a change.
    code, err = _code_and_error(_medusa(b2, data, out, "--max-steps", "7", "--seed", "7", "--resume", "auto"),
                                capsys)
    assert code == 2 and "batch-size 4 → 2" in err, err


def test_allow_changed_settings_names_known_settings_and_needs_resume(copy, capsys):
    model, data, out = copy
    code, err = _code_and_error(_medusa(model, data, out, "--resume", "auto", "--allow-changed-settings", "colour"),
                                capsys)
    assert code == 2 and "--allow-changed-settings: unknown setting colour; the settings a resume checks are" in err
    code, err = _code_and_error(_medusa(model, data, out, "--allow-changed-settings", "lr"), capsys)
    assert code == 2 and "--allow-changed-settings is for a resumed run" in err


def test_a_checkpoint_without_recorded_settings_resumes_with_a_note(copy, capsys):
    model, data, out = copy
    last = _step(out, STEPS)
    state = torch.load(last / ckpt.STATE_FILE, weights_only=True)
    del state["settings"]
    torch.save(state, last / ckpt.STATE_FILE)
    (last / ckpt.MANIFEST_FILE).unlink()  # as an earlier version wrote it
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS + 1), "--resume", "auto",
                                        "--seed", "3"), capsys)
    assert code == 0, err
    assert f"note: {last} has no {ckpt.MANIFEST_FILE}" in err
    assert f"note: {last} records no run settings (written by an earlier version)" in err


def test_a_checkpoint_from_before_adam_eps_was_recorded_ran_at_the_default(copy, capsys):
    """Checkpoints record --adam-eps since it exists; one that does not ran at AdamW's 1e-8, so another ε is a
    change to name, and the default is none."""
    model, data, out = copy
    last = _step(out, STEPS)
    state = torch.load(last / ckpt.STATE_FILE, weights_only=True)
    assert state["settings"].pop("adam-eps") == 1e-8
    torch.save(state, last / ckpt.STATE_FILE)
    (last / ckpt.MANIFEST_FILE).unlink()  # as an earlier version wrote it
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS + 1), "--resume", "auto",
                                        "--adam-eps", "1e-6"), capsys)
    assert code == 2 and "was trained with other settings: adam-eps 1e-08 → 1e-06." in err, err
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS + 1), "--resume", "auto"), capsys)
    assert code == 0, err


# --------------------------------------------------------------------------------------------- damaged checkpoints


def _emptied(path: Path) -> None:
    path.write_bytes(b"")


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _bit_flipped(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0x10  # in the data: the file still loads, with a wrong number
    path.write_bytes(bytes(raw))


DAMAGE = {"emptied": (_emptied, r"is 0 bytes, its manifest says \d+"),
          "truncated": (_truncated, r"is \d+ bytes, its manifest says \d+"),
          "bit-flipped": (_bit_flipped, r"'s SHA-256 differs from its manifest's \(its bytes changed\)"),
          "missing": (Path.unlink, "is missing")}


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("file", [ckpt.STATE_FILE, HEADS])
def test_a_damaged_last_checkpoint_is_passed_over_and_the_run_ends_bit_for_bit(file, how, run, copy, capsys):
    model, data, out = copy
    damage, said = DAMAGE[how]
    damage(_step(out, STEPS) / file)
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS), "--resume", "auto"), capsys)
    assert code == 0, err
    warning = (f"warning: checkpoint {_step(out, STEPS)} is damaged: {re.escape(file)} ?{said}; resuming from "
               f"{ckpt.step_dir_name(STEPS - 2)}, the newest intact one before it")
    assert re.search(warning, err), err
    assert _steps(out) == list(range(1, STEPS + 1))
    assert (_step(out, STEPS) / HEADS).read_bytes() == run[3]  # as the undamaged run ended, bit for bit
    assert ckpt.damage(_step(out, STEPS)) is None


def test_a_damaged_checkpoint_named_outright_is_refused(copy, capsys):
    model, data, out = copy
    _bit_flipped(_step(out, STEPS) / ckpt.STATE_FILE)
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS), "--resume",
                                        str(_step(out, STEPS))), capsys)
    assert code == 2 and f"checkpoint {_step(out, STEPS)} is damaged: {ckpt.STATE_FILE}'s SHA-256 differs" in err


def test_every_checkpoint_damaged_is_refused_naming_each(copy, capsys):
    model, data, out = copy
    for step in (STEPS - 2, STEPS):
        _truncated(_step(out, step) / HEADS)
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS), "--resume", "auto"), capsys)
    assert code == 2 and f"no intact checkpoint under {out / 'checkpoints'} (step_000004: {HEADS} is" in err, err
    assert f"; step_000002: {HEADS} is" in err


def test_an_old_checkpoint_without_its_heads_file_is_called_damaged(copy, capsys):
    """Without a manifest, a lost heads file was taken for a causal-LM checkpoint: "written by `liger-models
    train`". trainer_state.pt records the command that wrote it."""
    model, data, out = copy
    last = _step(out, STEPS)
    (last / ckpt.MANIFEST_FILE).unlink()
    (last / HEADS).unlink()
    code, err = _code_and_error(_medusa(model, data, out, "--max-steps", str(STEPS), "--resume", "auto"), capsys)
    assert code == 2 and "`liger-models train`" not in err, err
    assert (f"checkpoint {last} is damaged: it was written by `liger-models train-medusa --stage 1`, but {HEADS} "
            "is missing") in err


def test_checkpoints_after_the_one_latest_names_are_not_fallen_back_to(tmp_path):
    """A run resumed from step 2 wrote step 3 (now `latest`) beside an earlier run's step 4: with step 3 damaged,
    the resume goes back to step 2, never forward to the other run's step 4."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 3):
        ckpt.save_checkpoint(root, step, lambda tmp, final: None, {"x": step})
    _truncated(root / "step_000003" / ckpt.STATE_FILE)
    found = ckpt.newest_intact(root)
    assert found.checkpoint == root / "step_000002" and found.verified
    assert [p.name for p, _ in found.damaged] == ["step_000003"]


# --------------------------------------------------------------------------------------------- a full disk


# Test-only: run the CLI with an ENOSPC raised by the write of <what> (the model file, trainer_state.pt, or the
# metrics log) once <when> is in its path (or for metrics, at the <when>-th append), as the writers raise it.
NO_SPACE = """
import builtins, errno, os, sys
import safetensors.torch
from safetensors import SafetensorError
what, when = sys.argv[1], sys.argv[2]
real_save_file, real_open, appends = safetensors.torch.save_file, builtins.open, [0]

def full(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

def save_file(tensors, path, metadata=None):
    if what == "model" and when in str(path):
        with real_open(path, "wb") as f:
            f.write(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return real_save_file(tensors, path, metadata=metadata)

class Full:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        full(self.f.name)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

def open_(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    name = os.path.basename(str(file))
    if what == "state" and name == "trainer_state.pt" and when in str(file):
        return Full(f)
    if what == "metrics" and name == "metrics.jsonl" and "a" in mode:
        appends[0] += 1
        if appends[0] == int(when):
            return Full(f)
    return f

safetensors.torch.save_file, builtins.open = save_file, open_
import io, pathlib
pathlib.Path.open = lambda self, mode="r", *a, **k: open_(self, mode, *a, **k)
from liger_models.cli import main
sys.exit(main(sys.argv[3:]))
"""
ENV = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}


def _train(model: Path, data: Path, out: Path) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "10",
            "--save-every", "5", "--seq-len", "32", "--batch-size", "2", "--device", "cpu", "--dtype", "fp32",
            "--no-data-cache", "--quiet"]


def _hidden(out: Path) -> set[str]:
    """Every hidden entry under the run directory but its lock file: temporaries."""
    return {os.path.relpath(os.path.join(d, n), out) for d, dirs, files in os.walk(out) for n in dirs + files
            if n.startswith(".") and n != LOCK_FILE}


def _assert_stopped_cleanly(proc: subprocess.CompletedProcess, out: Path, what: str) -> None:
    """One line naming the full disk, where, the space left and the intact checkpoint; step 5 intact; nothing
    else left behind."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    kept = _step(out, 5)
    assert re.fullmatch(rf"liger-models: error: disk full \(no space left on device\) writing {re.escape(what)} "
                        rf"\([\d.]+ (bytes|KiB|MiB|GiB|TiB) free there\); the last checkpoint, {re.escape(str(kept))},"
                        r" is intact: free some space, then continue with --resume auto", lines[0]), lines[0]
    assert ckpt.find_latest(out / "checkpoints") == kept
    assert ckpt.has_manifest(kept) and ckpt.damage(kept) is None
    assert not _step(out, 10).exists() and _hidden(out) == set()


@pytest.mark.parametrize("what, when", [("model", "step_000010"), ("state", "step_000010"), ("metrics", "8")])
def test_a_full_disk_stops_the_run_in_one_line_with_the_last_checkpoint_intact(what, when, tiny_model_dir,
                                                                              text_file, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", NO_SPACE, what, when, *_train(tiny_model_dir, text_file, out)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    where = f"the metrics log {out / 'metrics.jsonl'}" if what == "metrics" else f"checkpoint {_step(out, 10)}"
    _assert_stopped_cleanly(proc, out, where)
    if what == "model":  # space freed, the run continues from the intact checkpoint
        proc = subprocess.run([sys.executable, "-m", "liger_models.cli", *_train(tiny_model_dir, text_file, out),
                               "--resume", "auto"], env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and _steps(out) == list(range(1, 11)), proc.stderr[-3000:]


def test_a_full_tmpfs_stops_the_run_in_one_line_with_the_last_checkpoint_intact(tiny_model_dir, text_file,
                                                                                tmp_path):
    """The real thing where this machine lets the test mount a filesystem (root): room for one checkpoint and a
    half, so the save of step 10 runs out of space."""
    mount = tmp_path / "small"
    mount.mkdir()
    one = sum(3 * p.stat().st_size if p.suffix == ".safetensors" else p.stat().st_size
              for p in tiny_model_dir.iterdir()) + (64 << 10)  # the weights, AdamW's two moments, the rest
    size = (one * 3 // 2) // 4096 * 4096
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): the injected ENOSPC tests cover the same paths")
    try:
        out = mount / "run"
        proc = subprocess.run([sys.executable, "-m", "liger_models.cli", *_train(tiny_model_dir, text_file, out)],
                              env=ENV, capture_output=True, text=True, timeout=300)
        _assert_stopped_cleanly(proc, out, f"checkpoint {_step(out, 10)}")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
