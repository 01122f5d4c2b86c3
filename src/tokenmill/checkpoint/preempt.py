"""Preemption: SIGTERM and Ctrl-C save a checkpoint and stop, SIGUSR1 saves one and goes on.

A scheduler that takes a run's machine back (Slurm preemption, a Kubernetes eviction, `docker stop`) sends
SIGTERM and, after a grace period (30 s by default on all three), SIGKILL. While the loop runs, `Preemption`
turns the signal into a flag that the loop reads at its next step boundary:

    with Preemption(timeout_s=20, root=out / "checkpoints", steps=200) as preempt:
        for step in ...:
            ...                                    # the step runs to its end: no half-applied update
            if preempt.asked(step) or step % every == 0:
                preempt.saved(step, save(step))    # after SIGTERM / SIGINT: raises Preempted (exit status 75)

- SIGTERM or the first Ctrl-C (SIGINT): the current step finishes, a checkpoint is written, one line says what
  was saved, where and how to resume, and `Preempted` ends the run; `tokenmill train` exits with status
  `EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again later"), which a requeueing scheduler can match.
- A watchdog bounds that: if the step and the save have not finished `timeout_s` after the signal, the process
  exits at once with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT: what a shell reports for a
  process the signal killed), after deleting its own half-written `.tmp-step_*` folder; a `step_*` folder is
  complete or absent (`checkpoint.atomic`), so the next resume loads the last complete checkpoint.
- A second Ctrl-C raises KeyboardInterrupt at once (a save under way deletes its temporary folder); a second
  SIGTERM changes nothing (under Slurm a job step's processes can get it twice: from Slurm and from torchrun).
- SIGUSR1: a checkpoint at the next step boundary, and the run goes on.

With several ranks (torchrun, where the launcher forwards SIGTERM and SIGINT to every rank) the flag is agreed
on at each boundary (`agree`: the maximum over the ranks), so a signal to any one rank makes all of them save
(a collective) and stop at the same step.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from tokenmill.tracking import events
from tokenmill.types import TokenmillError

if TYPE_CHECKING:
    from typing import Self  # Python 3.11

EXIT_PREEMPTED = 75  # stopped by a signal after saving: rerun with checkpoint.resume true to continue
DEFAULT_TIMEOUT_S = 20.0  # from the signal to the saved checkpoint; under the schedulers' usual 30 s grace
NONE, SAVE, STOP = 0, 1, 2  # what a step boundary is asked to do, in increasing order (ranks agree on the max)
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(TokenmillError):
    """The run stopped at a step boundary on SIGTERM or SIGINT; the message says what was saved and how to go on."""

    exit_code = EXIT_PREEMPTED
    exit_at_once = True  # the command line exits without the interpreter's teardown (the run is saved and closed)

    def __init__(self, message: str, *, signal_name: str, step: int, path: Path | None) -> None:
        super().__init__(message)
        self.signal_name, self.step, self.path = signal_name, step, path


class _InterruptedAgain(KeyboardInterrupt):
    """A second Ctrl-C while stopping: the run unwinds at once (a save under way deletes its temporary folder)."""

    exit_at_once = True  # the command line exits without the interpreter's teardown


def _say(text: str) -> None:
    """A line on stderr that is safe inside a signal handler (no Python buffer that the handler interrupted)."""
    os.write(2, (text + "\n").encode())


class Preemption:
    """The signal handlers of a training loop (a context manager; see the module docstring).

    `timeout_s`: the bound from SIGTERM / SIGINT to the exit (0: no handlers at all, the signals act as they do
    on any process). `root`: the checkpoint folder (its `.tmp-` folders of this process are deleted when the
    bound expires). `steps`: the run's total, for the message. `agree`: a step boundary's request over the
    ranks (the maximum; one process: itself). `say`: where the SIGUSR1 line goes. `resume_hint`: how to go on,
    the end of the stop line. `field`: the setting of the bound, named in the lines (None: a fixed bound).
    Handlers are installed only from the main thread (elsewhere Python refuses)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, *, root: Path | None = None, steps: int | None = None,
                 agree: Callable[[int], int] = lambda request: request, say: Callable[[str], None] = _say,
                 resume_hint: str = "rerun the same command with --checkpoint.resume true",
                 field: str | None = "checkpoint.preempt_timeout_s") -> None:
        self.timeout_s, self.root, self.steps, self.agree, self.say = timeout_s, root, steps, agree, say
        self.resume_hint = resume_hint
        self.bound = f"{timeout_s:g} s" + (f"; {field}" if field else "")
        self.stop_signal: str | None = None  # name of the signal that asked to stop
        self.signalled_at: float | None = None
        self.saved_path: Path | None = None
        self._signum = 0
        self._save_asks = self._save_seen = 0  # SIGUSR1s received, and those a boundary has taken
        self._request = NONE  # what the last boundary agreed on
        self._previous: dict[int, object] = {}
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def __enter__(self) -> Self:
        if self.timeout_s <= 0 or threading.current_thread() is not threading.main_thread():
            return self
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        self._watchdog = threading.Thread(target=self._watch, name="tokenmill-preempt", daemon=True)
        self._watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    # -- the handler (runs in the main thread, between two bytecodes of whatever it interrupted) --------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:
            self._save_asks += 1
            _say(f"tokenmill: {name}: a checkpoint at the end of this step, then training goes on")
            return
        if self.stop_signal is not None:
            if signum == signal.SIGINT:  # Ctrl-C again: the user does not want to wait
                _say("tokenmill: interrupted again: exiting now, without the checkpoint")
                raise _InterruptedAgain
            return  # a repeated SIGTERM (Slurm and torchrun can both send one): already stopping
        self.stop_signal, self._signum, self.signalled_at = name, signum, time.monotonic()
        again = "; Ctrl-C again to exit at once" if signum == signal.SIGINT else ""
        _say(f"tokenmill: {name}: finishing this step, then saving and exiting (at most {self.bound}){again}")

    def _watch(self) -> None:
        while not self._closed.wait(0.1):
            if self.signalled_at is None or time.monotonic() - self.signalled_at < self.timeout_s:
                continue
            if self.saved_path is not None:  # saved; what is left (closing workers) overran the bound
                _say(f"tokenmill: {self.stop_signal}: checkpoint {self.saved_path} saved; exiting now")
                os._exit(EXIT_PREEMPTED)
            removed = self._tidy()
            _say(f"tokenmill: {self.stop_signal}: not saved within the bound ({self.bound}); exiting without a "
                 f"checkpoint{removed}. A resume starts from the last "
                 "complete checkpoint")
            os._exit(128 + self._signum)

    def _tidy(self) -> str:
        """Delete this process's half-written checkpoint folder, if any (the writer is abandoned)."""
        if self.root is None or not self.root.is_dir():
            return ""
        mine = [p for p in self.root.glob(".tmp-step_*") if p.name.endswith(f"-{os.getpid()}")]
        for path in mine:
            shutil.rmtree(path, ignore_errors=True)
        return f" (deleted the half-written {mine[0].name})" if mine else ""

    # -- the loop's side ---------------------------------------------------------------------------------------
    def asked(self, step: int) -> int:
        """At the boundary after `step`: NONE, SAVE (SIGUSR1) or STOP (SIGTERM / SIGINT), agreed over the ranks."""
        own = STOP if self.stop_signal is not None else SAVE if self._save_asks > self._save_seen else NONE
        self._save_seen = self._save_asks
        self._request = self.agree(own)
        if self._request == STOP and self.stop_signal is None:  # another rank was signalled
            self.stop_signal, self._signum = "a signal to another rank", signal.SIGTERM
            self.signalled_at = time.monotonic()  # this rank's watchdog bounds the save too
        return self._request

    def saved(self, step: int, path: Path) -> None:
        """After the boundary's checkpoint at `path`: say so for SIGUSR1; raise `Preempted` for a stop."""
        request, self._request = self._request, NONE
        if request == NONE:
            return
        elapsed = time.monotonic() - self.signalled_at if request == STOP and self.signalled_at else None
        events.emit("preempt", signal=self.stop_signal if request == STOP else "SIGUSR1", step=step, path=str(path),
                    stop=request == STOP, seconds=None if elapsed is None else round(elapsed, 3))
        if request == SAVE:
            self.say(f"SIGUSR1: checkpoint of step {step} saved to {path}; training goes on")
            return
        self.saved_path = path
        of = f" of {self.steps}" if self.steps else ""
        raise Preempted(f"stopped by {self.stop_signal} after step {step}{of}: checkpoint saved to {path} "
                        f"{elapsed:.2f} s after the signal; to continue, {self.resume_hint} "
                        f"(exit status {EXIT_PREEMPTED})", signal_name=self.stop_signal, step=step, path=path)

    def stop_now(self, step: int) -> bool:
        """For a loop that keeps no checkpoints (the offline trainers): whether to stop after `step`."""
        request = self.asked(step)
        if request == SAVE:
            self.say("SIGUSR1: this run keeps no checkpoints; nothing saved")
        return request == STOP
