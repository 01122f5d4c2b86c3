"""The efficiency report on hand-made step timings: the ideal step (sum when generation and training take
turns, max when they overlap), where the time went, and the advice that follows from it."""

from __future__ import annotations

import json

import pytest

from tokenmill.health.report import EfficiencyReport, advice, efficiency_metrics
from tokenmill.tracking import MetricsLogger

SYNC = {"timing_s/step": 10.0, "timing_s/generate": 6.0, "timing_s/reward": 1.0, "timing_s/train": 2.0,
        "timing_s/reference": 0.5, "timing_s/sync": 0.25}
ASYNC = {"timing_s/step": 5.0, "timing_s/wait": 2.0, "timing_s/train": 2.5, "timing_s/sync": 0.5,
         "async/producer_generate_s": 4.0, "async/producer_reward_s": 0.5}


def test_a_sync_step_ideal_is_the_sum_and_the_rest_is_idle():
    m = efficiency_metrics(SYNC)
    assert m["efficiency/ideal_s"] == pytest.approx(6.0 + 1.0 + 2.5)  # reference pass counts as training
    assert m["efficiency/ratio"] == pytest.approx(0.95)
    assert m["efficiency/async"] == 0.0
    shares = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("efficiency/share/")}
    assert shares == pytest.approx({"generate": 0.6, "reward": 0.1, "train": 0.25, "sync": 0.025, "idle": 0.025})


def test_an_async_step_ideal_is_the_max_and_waiting_is_idle():
    m = efficiency_metrics(ASYNC)
    assert m["efficiency/ideal_s"] == pytest.approx(max(4.0 + 0.5, 2.5))
    assert m["efficiency/ratio"] == pytest.approx(0.9)
    assert m["efficiency/share/idle"] == pytest.approx(2.0 / 5.0)  # the wait stage
    assert m["efficiency/share/generate"] == pytest.approx(0.8) and m["efficiency/async"] == 1.0
    assert efficiency_metrics({"reward/mean": 1.0}) == {}  # an untimed row


def test_advice_names_the_biggest_part():
    assert advice({"generate": 0.78, "train": 0.2}, False, occupancy=0.3) == (
        "generation is 78% of the step and the engine batch is 30% occupied: raise controller.prompts_per_step or "
        "env.max_concurrent so each engine batch holds more sequences, or generate beside training "
        "(engine.placement: thread) so the two overlap")
    assert advice({"train": 0.7, "generate": 0.2}, False).startswith("training is 70% of the step: raise "
                                                                      "training.micro_batch_tokens")
    assert advice({"idle": 0.5, "train": 0.4}, True).startswith("the trainer waits for rollouts 50% of the step")
    assert advice({"sync": 0.5, "train": 0.4}, True).startswith("the weight sync is 50% of the step")


def test_finish_writes_report_json_an_event_row_and_a_console_line(tmp_path):
    lines: list[str] = []
    logger = MetricsLogger(tmp_path, total_steps=3, console="none")
    try:
        report = EfficiencyReport(tmp_path, say=lines.append)
        slow_first = SYNC | {"timing_s/step": 100.0}  # the first step warms up: left out
        for row in (slow_first, SYNC, SYNC | {"timing_s/generate": 4.0, "timing_s/step": 8.0}):
            report.add(row | efficiency_metrics(row))
        summary = report.finish()
    finally:
        logger.close()
    assert summary["steps"] == 2 and summary["mode"] == "sync"
    assert summary["step_s"] == pytest.approx(9.0) and summary["ideal_s"] == pytest.approx((9.5 + 7.5) / 2)
    assert summary["shares"]["generate"] == pytest.approx((0.6 + 0.5) / 2)
    assert summary["advice"].startswith("generation is 55% of the step:")
    assert json.loads((tmp_path / "report.json").read_text()) == summary
    [row] = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert row["event"] == "efficiency_report" and row["advice"] == summary["advice"]
    assert lines == [(f"efficiency: step 9 s vs ideal 8.5 s (94%, sync); generate 55% | reward 11% | train 28% | "
                     f"sync 3% | idle 3%. Most would help: {summary['advice']}")]


def test_restarts_in_events_jsonl_are_listed_in_the_report(tmp_path):
    """The `restart` rows a run wrote while it went on after failures (a Ray trainer group rebuilt, an engine
    replica replaced) come back in report.json, in order, and as one console line."""
    from tokenmill.tracking import events

    lines: list[str] = []
    logger = MetricsLogger(tmp_path, total_steps=2, console="none")
    try:
        events.emit("stage", stage="train", step=1)
        events.emit("restart", role="engine replica", restart=1, old="http://127.0.0.1:1", new="http://127.0.0.1:2")
        events.emit("restart", role="trainer", restart=1, reason="trainer update: trainer rank 1 died", seconds=9.5)
        report = EfficiencyReport(tmp_path, say=lines.append)
        for row in (SYNC, SYNC):
            report.add(row | efficiency_metrics(row))
        summary = report.finish()
    finally:
        logger.close()
    assert [(r["role"], r["restart"]) for r in summary["restarts"]] == [("engine replica", 1), ("trainer", 1)]
    assert summary["restarts"][1]["reason"] == "trainer update: trainer rank 1 died"
    assert json.loads((tmp_path / "report.json").read_text())["restarts"] == summary["restarts"]
    assert lines[1] == "restarts: 1 engine replica, 1 trainer (events.jsonl)"
