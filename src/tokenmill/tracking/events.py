"""`events.jsonl`: one small JSON line each time the loop enters a stage, for live views to tail.

The trainer never talks to a UI (the Composer tails this file by byte offset). A line is
`{"event": "stage", "stage": "train", "step": 3, "t": 1735732800.12, "side": "trainer"}` (`side` only
when the stage ran on a known side of an async run: the rollout `producer` thread or the `trainer`).

Only a run logger with an output folder opens the file and makes it the active sink (`activate`);
without one, `emit` is a no-op, so tests and library calls that time stages write nothing. The sink is
process-wide rather than a context variable because the async producer thread must reach it too (threads
do not inherit context variables), and it is held weakly so that a logger dropped without `close()`
does not keep a later, logger-less run writing into its folder.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from pathlib import Path
from typing import Any

FILENAME = "events.jsonl"


class EventLog:
    """An append-only JSONL file shared by the trainer and the producer thread (a lock keeps lines whole)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return
            # one write and a flush (no fsync): the line reaches the OS for a tailing reader at once, and a
            # stage entry costs microseconds even at thousands of steps
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


_active: weakref.ref[EventLog] | None = None
_active_lock = threading.Lock()


def activate(log: EventLog) -> None:
    """Make `log` the sink for stage events (the latest activated run logger wins)."""
    global _active
    with _active_lock:
        _active = weakref.ref(log)


def deactivate(log: EventLog) -> None:
    """Stop sending events to `log` (a no-op if another sink has been activated since)."""
    global _active
    with _active_lock:
        if _active is not None and _active() is log:
            _active = None


def active() -> EventLog | None:
    ref = _active
    return ref() if ref is not None else None


def emit(event: str, **fields: Any) -> None:
    """Append `{"event": event, **fields, "t": now}` (a no-op when no run logger is active): what a run
    reports besides stages, e.g. a reward function's failures, so they are kept with the run even when the
    console is off."""
    log = active()
    if log is not None:
        log.write({"event": event, **fields, "t": round(time.time(), 4)})


def emit_stage(name: str, step: int | None, side: str | None = None) -> None:
    """Record that `step` entered stage `name` (a no-op when no run logger is active)."""
    log = active()
    if log is None:
        return
    record: dict[str, Any] = {"event": "stage", "stage": name, "step": step, "t": round(time.time(), 4)}
    if side is not None:
        record["side"] = side
    log.write(record)
