"""The tracker protocol: a sink for a run's per-step metrics (files, consoles, dashboards).

The run's `MetricsLogger` (`tracking/logger.py`) hands every step's metrics to each of its trackers: the
console (a rich progress bar or plain lines), TensorBoard and W&B when asked, and any you pass in. A tracker
for another dashboard is a class with these two methods:

    >>> class Printer:                                                            # doctest: +SKIP
    ...     def log(self, step, metrics): print(step, metrics.get("reward/mean"))
    ...     def close(self): pass
    >>> tokenmill.tracking.MetricsLogger("runs/x", total_steps=10, trackers=[Printer()])  # doctest: +SKIP

metrics.jsonl and samples.jsonl are written by the logger itself: they are the run's record, not a sink
that can be turned off.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """Receives each step's metrics (numbers, plus a few strings such as `bottleneck`; NaN where undefined)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the metrics of `step` (step 0 is the evaluation before training)."""
        ...

    def close(self) -> None:
        """Flush and release; called once at the end of the run."""
        ...


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a step's metrics (what a dashboard takes; strings and NaN left out)."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
