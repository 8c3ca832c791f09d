"""Training runs survive what clusters do to them, through the real CLI on a tiny model (subprocesses, CPU):
SIGTERM / SIGINT checkpoint the step reached and exit with 128 + the signal, and ``--resume auto`` continues to
the very weights of an uninterrupted run; SIGKILLs at chosen file operations of checkpoint, model, log and
data-cache writes leave nothing once the next run has started, and the run still ends bit-identical; a second run
into a directory in use is refused, a lock left by a killed run is taken over; under torchrun a signal reaching
one rank stops every rank after the same step. Plus the sweep's rules (liger_models.atomic) in-process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from liger_models import atomic
from liger_models.train import checkpointing as ckpt
from liger_models.train.run_dir import LOCK_FILE

pytestmark = pytest.mark.usefixtures("reference_path")

ENV = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
LONG = 400  # steps of the runs that are signalled: ~5 ms each here, so a signal lands well before the end
RUN = ["--seq-len", "32", "--batch-size", "2", "--save-every", "5", "--keep-last", "2", "--log-every", "1000",
       "--device", "cpu", "--dtype", "fp32", "--quiet"]
TIMEOUT = 180


def _signals_as_in_a_terminal() -> None:
    """The runs under test start with SIGINT and SIGTERM at their defaults, as from a terminal. A shell runs a
    background job (`cmd &`, a CI script started that way) with SIGINT ignored, which children inherit and
    StopOnSignal leaves alone by design (a nohup'd run keeps running): the signal tests would then test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Test-only fault injection: `python -c KILL_AT <function> <name regex> <n> <liger-models argv...>` runs the CLI and
# SIGKILLs it just before the n-th call of <function> on a path whose last component matches <name regex>.
KILL_AT = """
import os, re, shutil, signal, sys
import torch
function, pattern, n = sys.argv[1], re.compile(sys.argv[2]), int(sys.argv[3])
owner, name = {"rename": (os, "rename"), "replace": (os, "replace"), "rmtree": (shutil, "rmtree"),
               "torch.save": (torch, "save")}[function]
real, calls = getattr(owner, name), 0
def armed(*args, **kwargs):
    global calls
    path = next((p for a in args if isinstance(p := getattr(a, "name", a), (str, os.PathLike))), "")  # or a file's
    if pattern.search(os.path.basename(os.fspath(path))):
        calls += 1
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
setattr(owner, name, armed)
from liger_models.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _train(model_dir, data, out, max_steps=LONG, *extra) -> list[str]:
    return ["train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
            "--max-steps", str(max_steps), *RUN, *extra]


def _cli(argv) -> list[str]:
    return [sys.executable, "-m", "liger_models.cli", *argv]


def _run(cmd) -> tuple[int, int, str]:
    """(exit status, pid, stderr) of ``cmd`` run to its end."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_signals_as_in_a_terminal)
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    return proc.wait(), proc.pid, err


def _start(cmd, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: nobody reads a pipe while the test waits
        return subprocess.Popen(cmd, env=ENV, stdout=f, stderr=subprocess.STDOUT, preexec_fn=_signals_as_in_a_terminal)


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for_training(proc: subprocess.Popen, out: Path, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not _steps(out):
        assert proc.poll() is None, f"the run ended before training (exit {proc.returncode}): {log.read_text()}"
        assert time.monotonic() < deadline, "no training step within the time limit"
        time.sleep(0.05)


def _final_weights(out: Path, steps: int = LONG) -> bytes:
    return (out / "checkpoints" / ckpt.step_dir_name(steps) / "model.safetensors").read_bytes()


def _hidden(out: Path) -> set[str]:
    """Every hidden entry under the run directory but its lock file and the data cache's directory: temporaries."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), out)
            if name.startswith(".") and rel not in (LOCK_FILE, ".data_cache"):
                found.add(rel)
    return found


@pytest.fixture(scope="module")
def reference(tiny_model_dir, text_file, tmp_path_factory) -> bytes:
    """The final weights of an uninterrupted LONG-step run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    code, _, err = _run(_cli(_train(tiny_model_dir, text_file, out)))
    assert code == 0, err[-3000:]
    return _final_weights(out)


# --------------------------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_checkpoints_the_step_reached_and_the_run_resumes_exactly(sig, code, reference, tiny_model_dir,
                                                                             text_file, tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(_cli(_train(tiny_model_dir, text_file, out)), log)
    _wait_for_training(proc, out, log)
    delay = random.Random(torch.initial_seed()).uniform(0, 0.6)  # replayable with the printed LIGER_TEST_SEED
    time.sleep(delay)
    proc.send_signal(sig)
    assert proc.wait(timeout=TIMEOUT) == code, log.read_text()[-3000:]

    stopped = _steps(out)[-1]  # the step it was in when the signal came, finished and logged
    assert 0 < stopped < LONG, f"signal after {delay:.2f}s"
    assert f"stopped by {sig.name} after step {stopped}/{LONG}; checkpoint: " in log.read_text()
    assert ckpt.find_latest(out / "checkpoints").name == ckpt.step_dir_name(stopped)
    assert _hidden(out) == set()

    code, _, err = _run(_cli(_train(tiny_model_dir, text_file, out, LONG, "--resume", "auto")))
    assert code == 0, err[-3000:]
    assert _steps(out) == list(range(1, LONG + 1))
    assert _final_weights(out) == reference  # bit for bit


SIGNAL_TWICE = """
import os, signal, time
from liger_models.train.interrupt import DUPLICATE_S, StopOnSignal
with StopOnSignal(announce=False) as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)  # within DUPLICATE_S: the same request delivered twice
    time.sleep(0.2)
    print("recorded", stop.signum, flush=True)
    time.sleep(DUPLICATE_S)
    os.kill(os.getpid(), signal.SIGINT)  # a second request
    time.sleep(5)
print("survived the second signal", flush=True)
"""


def test_a_second_signal_ends_the_process_at_once_but_a_duplicate_delivery_does_not():
    proc = subprocess.run([sys.executable, "-c", SIGNAL_TWICE], env=ENV, capture_output=True, text=True,
                          preexec_fn=_signals_as_in_a_terminal, timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]
    assert proc.stdout == f"recorded {int(signal.SIGTERM)}\n"


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's workers (its children, told apart by their RANK)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher.pid:
            rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[int(rank)] = int(entry)
    return ranks


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tiny_model_dir, text_file,
                                                                                   tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "liger_models.cli", *_train(tiny_model_dir, text_file, out, 4000)]
    proc = _start(cmd, log)
    _wait_for_training(proc, out, log)
    ranks = _rank_pids(proc)
    assert sorted(ranks) == [0, 1], ranks
    time.sleep(random.Random(torch.initial_seed()).uniform(0, 0.5))
    os.kill(ranks[1], signal.SIGTERM)  # rank 0 is never signalled: it learns of the stop from rank 1
    proc.wait(timeout=TIMEOUT)
    text = log.read_text()
    stopped = _steps(out)[-1]
    assert f"stopped by SIGTERM after step {stopped}/4000; checkpoint: " in text, text[-3000:]
    assert ckpt.find_latest(out / "checkpoints").name == ckpt.step_dir_name(stopped)
    # Rank 1 exits with 143; torchrun then ends whichever worker is still leaving (rank 0 may be, after the final
    # barrier), so rank 0's own status is not asserted: its checkpoint and message above were written before that.
    assert "exitcode  : 143" in text


# --------------------------------------------------------------------------------------------- kills


# (function, name of its path, which call): each SIGKILL leaves a different leftover behind, in this order.
KILLS = [
    ("replace", r"\.safetensors\..*\.liger-tmp$", 1),  # a data-cache file complete under its temporary name
    ("rename", r"^\.\.step_.*\.liger-tmp$", 1),  # the model writer's swap: its staged copy of the model complete
    ("torch.save", r"^trainer_state\.pt$", 1),  # a checkpoint with its model files and no state yet
    ("replace", r"^\.latest\.", 2),  # step 10 complete, `latest` still naming step 5
    ("replace", r"^\.metrics\.jsonl\.", 1),  # a resume (from step 5) trimming the log
    ("rename", r"^\.step_000010\.[^.]*\.liger-tmp$", 2),  # a re-save of step 10 between its two renames
    ("rmtree", r"\.liger-pruned$", 1),  # the deletion of an old copy begun
]


def test_sigkills_at_file_operations_leave_no_temporaries_and_the_run_ends_exactly(reference, tiny_model_dir,
                                                                                    text_file, tmp_path):
    out = tmp_path / "run"
    argv = _train(tiny_model_dir, text_file, out, LONG, "--resume", "auto")
    before: set[str] = set()
    for function, pattern, n in KILLS:
        code, pid, err = _run([sys.executable, "-c", KILL_AT, function, pattern, str(n), *argv])
        why = f"killed at {function} {pattern} #{n}: {err[-3000:]}"
        assert code == -signal.SIGKILL, why
        assert not before & _hidden(out), why  # what the previous kill left went when this run started
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == pid  # the dead run's lock was taken over
        before = _hidden(out)
        assert before, why  # this kill left something for the next run to clear
    code, _, err = _run(_cli(argv))
    assert code == 0, err[-3000:]
    assert _hidden(out) == set()
    assert _steps(out) == list(range(1, LONG + 1))
    assert _final_weights(out) == reference  # bit for bit, after len(KILLS) kills and resumes


# --------------------------------------------------------------------------------------------- the run lock


def test_a_second_run_into_a_directory_in_use_is_refused(tiny_model_dir, text_file, tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    first = _start(_cli(_train(tiny_model_dir, text_file, out, 100_000)), log)
    _wait_for_training(first, out, log)
    code, _, err = _run(_cli(_train(tiny_model_dir, text_file, out, 50, "--resume", "auto")))
    assert code == 2 and f"liger-models: error: {out} is in use by another run (pid {first.pid}, started at " in err
    assert first.poll() is None  # the first run goes on
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=TIMEOUT) == 143, log.read_text()[-3000:]
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1))  # its log alone, in order
    assert ckpt.find_latest(out / "checkpoints").name == ckpt.step_dir_name(steps[-1])


# --------------------------------------------------------------------------------------------- the sweep's rules


def _leftover(directory: Path, target: str, kind: str = "tmp", host: str = atomic.HOST, pid: int | None = None,
              age_s: float = 0.0) -> Path:
    path = directory / f".{target}.{host}-{os.getpid() if pid is None else pid}-0123abcd.liger-{kind}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sweep_clears_only_what_a_writer_that_is_gone_left(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        ours = _leftover(tmp_path, "a")
        dead = _leftover(tmp_path, "b", pid=_dead_pid())
        live = _leftover(tmp_path, "c", pid=alive.pid)
        # The pid now belongs to a process younger than the temporary: not its writer (a reused pid).
        reused = _leftover(tmp_path, "d", pid=alive.pid, age_s=600)
        other_host_old = _leftover(tmp_path, "e", host="0" * 8, pid=1, age_s=600)
        other_host_new = _leftover(tmp_path, "f", host="0" * 8, pid=1)
        (tmp_path / ".g.tmp").mkdir()  # not of the scheme: never touched
        assert atomic.sweep(tmp_path) == sorted([ours, dead, reused], key=lambda p: p.name)
        assert {live, other_host_old, other_host_new} <= set(tmp_path.iterdir())
        # Under a run lock held since now, another host's temporary older than the lock is a leftover.
        assert atomic.sweep(tmp_path, locked_since=time.time() - 60) == [other_host_old]
        assert {p.name for p in tmp_path.iterdir()} == {live.name, other_host_new.name, ".g.tmp"}
    finally:
        alive.kill()
        alive.wait()


def test_sweep_puts_back_the_previous_copy_of_a_swap_cut_between_its_renames(tmp_path):
    put_back = _leftover(tmp_path, "model", "old")
    superseded = _leftover(tmp_path, "step_000004", "old")
    (tmp_path / "step_000004").mkdir()
    of_a_temporary = _leftover(tmp_path, atomic.temp_path(tmp_path / "step_000005").name, "old")
    pruned = _leftover(tmp_path, "step_000003", "pruned")
    assert len(atomic.sweep(tmp_path)) == 4 and not {put_back, superseded, of_a_temporary, pruned} & set(
        tmp_path.iterdir())
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "step_000004"]
