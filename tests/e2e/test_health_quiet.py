"""A healthy run raises no alarm: GRPO from the quickstart's warm start, with every alarm at its default.

The short run is in CI; the quickstart's full 200 steps is slow (`-m slow`)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.recipes import grpo


def _alarms(warm, out, steps: int) -> tuple[dict, list[dict]]:
    torch.set_num_threads(2)
    result = grpo(warm, out, steps=steps, num_eval=200, eval_every=0, console="none", say=lambda _: None)
    rows = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return result, [r for r in rows if r["event"] == "alarm"]


def test_a_healthy_run_raises_no_alarm(warm, tmp_path):
    result, alarms = _alarms(warm, tmp_path, steps=20)
    assert alarms == []
    assert result["last_metrics"]["groups/zero_variance_fraction"] < 1.0  # the alarms had something to read
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == 19


@pytest.mark.slow
def test_the_quickstart_raises_no_alarm_in_200_steps(warm, tmp_path):
    result, alarms = _alarms(warm, tmp_path, steps=200)
    assert alarms == [], [a["message"] for a in alarms]
    assert result["eval_after"]["eval/accuracy"] > result["eval_before"]["eval/accuracy"]
