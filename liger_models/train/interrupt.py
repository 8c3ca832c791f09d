"""SIGTERM and SIGINT as a request to stop cleanly at the next step boundary.

A cluster's scheduler sends SIGTERM before it kills a job (preemption, a time limit, ``scancel``; torchrun forwards
it to every worker), a user at the terminal sends SIGINT. Inside :class:`StopOnSignal` either one only records
the request: the training loop finishes the optimizer step in progress, every rank agrees on the stop at the same
step (trainer.py), a checkpoint is written the normal atomic way, and the run ends with :class:`Interrupted`, which
exits with 128 + the signal number (143 for SIGTERM, 130 for SIGINT), the status a shell reports for a process
the signal ended. A second signal, of either kind, ends the process at once, as if nothing had caught it, mid-step
or mid-save (the checkpoint then being written is a temporary that the next run deletes); one that comes within
DUPLICATE_S of the first is the same request delivered twice (Slurm signals every process of a job step, and
torchrun forwards the signal it got to its workers as well), not a second one.
"""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_S = 1.0


class Interrupted(SystemExit):
    """A run stopped by ``signum`` after writing ``checkpoint``, that of its last step: exits with 128 + ``signum``."""

    def __init__(self, signum: int, checkpoint):
        super().__init__(128 + signum)
        self.signum, self.checkpoint = signum, checkpoint


class StopOnSignal:
    """Within the ``with`` block, SIGTERM / SIGINT set :attr:`signum` (0 until then) instead of ending the process.

    Signals that were ignored when the block was entered stay ignored (a shell starts background jobs with SIGINT
    ignored). Off the main thread nothing is installed (Python runs signal handlers on the main thread only)."""

    def __init__(self, announce: bool = True):
        self.signum = 0
        self.announce = announce
        self._previous: dict[int, object] = {}
        self._first = 0.0

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first = signum, now
            if self.announce:
                # os.write, not print: a handler that prints while the code it interrupted prints raises "reentrant
                # call".
                os.write(2, f"\nliger-models: {signal.Signals(signum).name} received: finishing the current step, "
                            "then writing a checkpoint (send it again to stop at once, without one)\n".encode())
        elif now - self._first > DUPLICATE_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
