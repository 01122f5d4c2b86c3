"""The run's logger writes metrics.jsonl and hands each step to every tracker, its own and the caller's."""

from __future__ import annotations

import json
import math

from tokenmill.tracking import MetricsLogger, Tracker
from tokenmill.tracking.logger import ConsoleTracker


class Recorder:
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict]] = []
        self.closed = 0

    def log(self, step, metrics):
        self.steps.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def test_every_tracker_gets_each_step_and_is_closed_once(tmp_path, capsys):
    mine = Recorder()
    assert isinstance(mine, Tracker) and isinstance(ConsoleTracker(3, "plain"), Tracker)
    logger = MetricsLogger(tmp_path, total_steps=3, console="plain", trackers=[mine])
    logger.log(1, {"reward/mean": 0.25, "kl": math.nan, "bottleneck": "generate"})
    logger.log(3, {"reward/mean": 0.5})
    logger.message("hello")
    logger.close()
    assert [s for s, _ in mine.steps] == [1, 3] and mine.closed == 1
    assert mine.steps[0][1]["bottleneck"] == "generate" and math.isnan(mine.steps[0][1]["kl"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.25, "kl": None, "bottleneck": "generate"},
                    {"step": 3, "reward/mean": 0.5}]
    assert capsys.readouterr().out.splitlines() == [
        "step 1/3 | reward 0.250 | kl nan | slowest generate", "step 3/3 | reward 0.500", "hello"]
