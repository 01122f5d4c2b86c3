"""The run's health checks behind one object, `Monitors`, that the loop calls at four points of a step.

A monitor is any object with one or more of these hooks (`Monitors` calls those it has, in list order):

    after_push(step) -> dict        after the weight push, in the `sync` stage: metrics for the step
                                    (the weight-sync probe: `probe/*`)
    watch_update(step) -> watch     before the policy update: an `UpdateWatch` that is shown the trainer's
                                    logprobs before the update, or None (the engine/trainer `mismatch/*`)
    after_step(step, metrics, groups)   after the step's metrics are logged (the efficiency report, the
                                    alarms: these may save a checkpoint and raise `AlarmStop`)
    finish()                        once the loop ended without an error (the efficiency report's summary)

`health_monitors` builds the checks of `cfg.health`, plus the run's own (`Run.monitors`), once the feed exists
(the probe scores the engine the feed pushes to).

    >>> with health_monitors(run, feed, save=lambda step: ...) as monitors:       # doctest: +SKIP
    ...     metrics |= monitors.after_push(step)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.health.alarms import Alarms
from tokenmill.health.mismatch import MismatchMonitor
from tokenmill.health.probe import WeightProbe
from tokenmill.health.report import EfficiencyReport
from tokenmill.types import Group

if TYPE_CHECKING:
    from typing import Self  # Python 3.11

    from tokenmill.training.update import UpdateWatch

HOOKS = ("after_push", "watch_update", "after_step", "finish")


class Monitors:
    """`monitors`, each with some of the hooks (module docstring), called as one. As a context manager it
    calls `finish` on a clean exit (an error, an `AlarmStop` among them, leaves the run unfinished)."""

    def __init__(self, monitors: Sequence[Any]) -> None:
        for m in monitors:
            if not any(callable(getattr(m, hook, None)) for hook in HOOKS):
                raise TypeError(f"{type(m).__name__} is no monitor: it has none of {', '.join(HOOKS)}")
        self.monitors = list(monitors)

    def _each(self, hook: str) -> list[Callable[..., Any]]:
        return [fn for m in self.monitors if callable(fn := getattr(m, hook, None))]

    def after_push(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for fn in self._each("after_push"):
            out |= fn(step)
        return out

    def watch_update(self, step: int) -> UpdateWatch | None:
        """The watches of this step's policy update as one (None: nobody watches)."""
        watches = [w for fn in self._each("watch_update") if (w := fn(step)) is not None]
        return watches[0] if len(watches) == 1 else (_Watches(watches) if watches else None)

    def after_step(self, step: int, metrics: dict[str, Any], groups: Sequence[Group] = ()) -> None:
        for fn in self._each("after_step"):
            fn(step, metrics, groups)

    def finish(self) -> None:
        for fn in self._each("finish"):
            fn()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()


class _Watches:
    """Several `UpdateWatch`es shown the same logprobs; their metrics merged."""

    def __init__(self, watches: list[Any]) -> None:
        self.watches = watches

    def __call__(self, batch, logprobs_B_T) -> None:
        for w in self.watches:
            w(batch, logprobs_B_T)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for w in self.watches:
            out |= w.metrics()
        return out


def health_monitors(run, feed, save: Callable[[int], None]) -> Monitors:
    """The checks of `run.cfg.health`, with `run.monitors` after the built-in ones and the alarms last (a
    `stop` alarm ends the step). `save(step)`: the checkpoint a `stop` alarm writes first."""
    say = run.logger.message
    return Monitors([
        WeightProbe(run, feed, say=say),  # did each push reach the engine?
        MismatchMonitor(run.cfg.health.mismatch_every, run.trainer.backend),  # the engine's logprobs against the trainer's
        EfficiencyReport(run.output_dir, say=say),  # step time against its ideal, and what would help most
        *run.monitors,
        # a warning is a console line and an events.jsonl row; a stop saves, then raises
        Alarms(run.cfg.health.alarms, say=say, save=save, hints=alarm_hints(run)),
    ])


def alarm_hints(run) -> dict[str, Any]:
    """Run settings the alarm messages quote."""
    gen = run.cfg.generation
    out: dict[str, Any] = {"max_tokens": gen.max_tokens, "temperature": gen.temperature,
                           "distillation": run.trainer.teacher is not None}
    for engine in (getattr(run.rollout.evaluator, "engine", None), run.rollout.engine):  # one that says how it samples
        if isinstance(getattr(engine, "temperature", None), (int, float)):
            out["engine_temperature"] = float(engine.temperature)
            break
    return out
