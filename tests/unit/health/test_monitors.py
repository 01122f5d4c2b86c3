"""`Monitors`: the health checks behind the loop's four hooks. The dispatch on the real checks (the report sees a
step before the alarms stop the run; `finish` only on a clean exit), and the contract a new check meets: one
object with some of the hooks, added to a real run, sees every push, update and step, and its metrics are
logged."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill.config.health import AlarmsConfig
from tokenmill.health.alarms import Alarms, AlarmStop
from tokenmill.health.mismatch import MismatchMonitor, MismatchWatch
from tokenmill.health.monitors import Monitors
from tokenmill.health.report import EfficiencyReport, efficiency_metrics

STEP = {"timing_s/step": 2.0, "timing_s/generate": 1.0, "timing_s/train": 0.5, "loss": 0.25}
ALL_OFF = {name: {"policy": "off"} for name in AlarmsConfig.model_fields}


def _checks(tmp_path, lines: list[str]) -> tuple[EfficiencyReport, Alarms, Monitors]:
    report = EfficiencyReport(tmp_path, say=lines.append)
    alarms = Alarms(AlarmsConfig(**ALL_OFF), say=lines.append)
    return report, alarms, Monitors([report, alarms])


def test_each_step_reaches_the_report_and_the_alarms_and_a_clean_exit_finishes(tmp_path):
    lines: list[str] = []
    report, alarms, monitors = _checks(tmp_path, lines)
    with monitors:
        for step in (1, 2, 3):
            monitors.after_step(step, STEP | efficiency_metrics(STEP), ())
        assert monitors.after_push(3) == {} and monitors.watch_update(3) is None  # neither has those hooks
    assert len(report.rows) == 3 and alarms.fired == []
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["steps"] == 2 and written["step_s"] == 2.0 and written["ideal_s"] == 1.5
    assert len(lines) == 1 and lines[0].startswith("efficiency: step 2 s vs ideal 1.5 s (75%, sync)")


def test_a_stop_alarm_ends_the_step_after_the_report_saw_it_and_nothing_is_finished(tmp_path):
    lines: list[str] = []
    report, alarms, monitors = _checks(tmp_path, lines)
    broken = STEP | {"loss": math.nan}
    with pytest.raises(AlarmStop, match=r"^loss is NaN at step 2"), monitors:
        monitors.after_step(1, STEP | efficiency_metrics(STEP), ())
        monitors.after_step(2, broken | efficiency_metrics(broken), ())
    assert len(report.rows) == 2 and [f.name for f in alarms.fired] == ["non_finite"]
    assert not (tmp_path / "report.json").exists()


class _Seen:
    """An `UpdateWatch` counting the trained tokens it is shown."""

    def __init__(self) -> None:
        self.tokens = 0.0

    def __call__(self, batch, logprobs_B_T) -> None:
        self.tokens += float((batch.weights_B_T > 0).sum())

    def metrics(self) -> dict[str, float]:
        return {"custom/watched_tokens": self.tokens}


class _Counting:
    """A new health check: every hook, each leaving a trace."""

    def __init__(self) -> None:
        self.pushes: list[int] = []
        self.steps: list[tuple[int, float, float]] = []
        self.finished = 0

    def after_push(self, step: int) -> dict[str, float]:
        self.pushes.append(step)
        return {"custom/pushes": float(len(self.pushes))}

    def watch_update(self, step: int) -> _Seen:
        return _Seen()

    def after_step(self, step, metrics, groups) -> None:
        self.steps.append((step, metrics["custom/pushes"], metrics["custom/watched_tokens"]))

    def finish(self) -> None:
        self.finished += 1


def test_watches_of_one_update_see_the_same_logprobs_and_merge():
    from types import SimpleNamespace

    backend = SimpleNamespace(temperature=0.5)
    monitors = Monitors([MismatchMonitor(2, backend), _Counting()])
    assert isinstance(monitors.watch_update(1), _Seen)  # the mismatch skips odd steps: the one watch alone
    both = monitors.watch_update(2)
    batch = SimpleNamespace(old_logprobs_B_T=torch.tensor([[0.0, -1.0, -2.0]]),
                            weights_B_T=torch.tensor([[0.0, 0.5, 0.5]]))
    both(batch, torch.tensor([[0.0, -1.5, -2.0]]))
    assert both.metrics() == pytest.approx({
        "mismatch/mean_abs": 0.25, "mismatch/max_abs": 0.5, "mismatch/kl": (math.exp(-0.5) - 0.5) / 2,
        "mismatch/out_of_range_frac": 0.0, "mismatch/tokens": 2.0, "mismatch/temperature": 0.5,
        "custom/watched_tokens": 2.0})
    assert Monitors([MismatchMonitor(0, backend)]).watch_update(2) is None
    assert isinstance(Monitors([MismatchMonitor(1, backend)]).watch_update(3), MismatchWatch)


def test_an_object_without_hooks_is_refused():
    with pytest.raises(TypeError, match="object is no monitor: it has none of after_push, watch_update"):
        Monitors([object()])


def test_a_check_added_to_the_run_sees_every_hook_and_its_metrics_are_logged(tiny_model_path, tmp_path):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    cfg = load_config(RLConfig, {
        "model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 6}, "controller": {"steps": 3, "prompts_per_step": 2},
        "health": {"mismatch_every": 1}, "tracking": {"output_dir": str(tmp_path), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    })
    run = build_run(cfg)
    counting = _Counting()
    run.monitors = (counting,)
    try:
        run_rl(run)
    finally:
        run.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["custom/pushes"] for r in rows] == [1.0, 2.0, 3.0] and counting.pushes == [1, 2, 3]
    # its watch and the built-in mismatch watch were shown the same tokens of the same update
    assert all(r["custom/watched_tokens"] == r["mismatch/tokens"] > 0 for r in rows)
    assert [s[:2] for s in counting.steps] == [(1, 1.0), (2, 2.0), (3, 3.0)] and counting.finished == 1
