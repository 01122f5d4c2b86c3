"""`with stage("generate"):` is the one way the loop is timed.

Each stage accumulates wall seconds and the tokens it reports; `StageTimer.report()` turns a step's
stages into `timing_s/<stage>`, `throughput/<stage>_tok_s`, each stage's share of the step and the
bottleneck (the stage with the largest share). Entering a stage also appends a line to the run's
`events.jsonl` (see `tracking.events`) when a run logger is active, so live views see the real stage.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenmill.tracking.events import emit_stage


@dataclass
class StageTimer:
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    current: str | None = None
    step: int | None = None  # the loop step these stages belong to (for the stage events)
    side: str | None = None  # "producer" / "trainer" in an async run; None when there is one side

    def add_tokens(self, name: str, count: int) -> None:
        self.tokens[name] = self.tokens.get(name, 0) + count

    def report(self) -> dict[str, float | str]:
        total = max(time.perf_counter() - self.started, 1e-9)
        out: dict[str, float | str] = {"timing_s/step": total}
        for name, sec in self.seconds.items():
            out[f"timing_s/{name}"] = sec
            out[f"timing_share/{name}"] = sec / total
            if self.tokens.get(name):
                out[f"throughput/{name}_tok_s"] = self.tokens[name] / max(sec, 1e-9)
        if self.seconds:
            out["bottleneck"] = max(self.seconds, key=self.seconds.__getitem__)
        return out


_current: contextvars.ContextVar[StageTimer | None] = contextvars.ContextVar("tokenmill_stage", default=None)


@contextlib.contextmanager
def step_timer(step: int | None = None, side: str | None = None) -> Iterator[StageTimer]:
    """Collect the stages of one step (`step` and `side` label its stage events)."""
    timer = StageTimer(step=step, side=side)
    token = _current.set(timer)
    try:
        yield timer
    finally:
        _current.reset(token)


@contextlib.contextmanager
def stage(name: str, tokens: int = 0) -> Iterator[StageTimer | None]:
    """Time a named stage of the current step (a no-op outside `step_timer`)."""
    timer = _current.get()
    if timer is None:
        yield None
        return
    previous, timer.current = timer.current, name
    emit_stage(name, timer.step, timer.side)
    start = time.perf_counter()
    try:
        yield timer
    finally:
        timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - start
        timer.current = previous
        if tokens:
            timer.add_tokens(name, tokens)
