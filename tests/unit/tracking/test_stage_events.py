"""Stage events: the trainer appends a line to `events.jsonl` per stage it enters (only with a run logger),
and the Composer streams them as resumable `stage` SSE events and reports the real current stage."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import tokenmill
from tokenmill.composer.app import create_app
from tokenmill.composer.runs import Cursor, RunError, RunManager
from tokenmill.serving import start_in_thread
from tokenmill.tracking import MetricsLogger, events, stage, step_timer

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def digit_share(prompts, completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _config(model: str, out: Path, **engine) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 64, "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 3},
        "training": {"seed": 3},
        "controller": {"steps": 3, "prompts_per_step": 2},
        "engine": {"threads": 1, **engine},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _stages(path: Path) -> list[dict]:
    """The stage rows of events.jsonl (besides them: the health alarms and the efficiency report)."""
    rows = _lines(path)
    assert {r["event"] for r in rows} <= {"stage", "alarm", "efficiency_report"}
    return [r for r in rows if r["event"] == "stage"]


@pytest.fixture(scope="module")
def grpo_run(tiny_model_path, tmp_path_factory) -> Path:
    """A 3-step colocated GRPO run, written inside a Composer runs folder."""
    runs = tmp_path_factory.mktemp("runs")
    tokenmill.train(_config(tiny_model_path, runs / "grpo"), rewards=[digit_share])
    return runs / "grpo"


def test_colocated_grpo_reports_generate_reward_train_sync_per_step(grpo_run):
    rows = _stages(grpo_run / "events.jsonl")
    assert [(r["step"], r["stage"]) for r in rows] == [
        (step, name) for step in (1, 2, 3) for name in ("generate", "reward", "train", "sync")
    ]
    assert all(r["event"] == "stage" and "side" not in r for r in rows)  # one side: none named
    times = [r["t"] for r in rows]
    assert times == sorted(times) and time.time() - 600 < times[0] <= times[-1] <= time.time()
    assert [r["step"] for r in _lines(grpo_run / "metrics.jsonl")] == [1, 2, 3]
    assert events.active() is None  # the run's logger closed: later stages write nowhere


def test_async_run_labels_producer_and_trainer_sides(tiny_model_path, tmp_path):
    out = tmp_path / "async"
    tokenmill.train(_config(tiny_model_path, out, placement="thread"), rewards=[digit_share])
    rows = _stages(out / "events.jsonl")
    producer = [(r["step"], r["stage"]) for r in rows if r.get("side") == "producer"]
    trainer = [(r["step"], r["stage"]) for r in rows if r.get("side") == "trainer"]
    assert len(producer) + len(trainer) == len(rows)
    assert producer == [(s, name) for s in (1, 2, 3) for name in ("generate", "reward")]
    assert trainer == [(s, name) for s in (1, 2, 3) for name in ("wait", "train", "sync")]
    # the trainer never starts training a step before the producer has scored it
    at = {(r.get("side"), r["step"], r["stage"]): i for i, r in enumerate(rows)}
    assert all(at["producer", s, "reward"] < at["trainer", s, "train"] for s in (1, 2, 3))


def test_no_logger_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert events.active() is None
    with step_timer(1) as timer, stage("generate"):
        pass
    assert timer.seconds.keys() == {"generate"} and list(tmp_path.iterdir()) == []
    logger = MetricsLogger(tmp_path / "run", total_steps=1, console="none")
    with step_timer(7, side="trainer"), stage("train"):
        pass
    with stage("sync"):  # outside a step: not timed, not reported
        pass
    logger.close()
    with step_timer(8), stage("train"):
        pass
    rows = _lines(tmp_path / "run" / "events.jsonl")
    assert [(r["stage"], r["step"], r["side"]) for r in rows] == [("train", 7, "trainer")]
    del logger  # a logger dropped without close() does not stay the sink either
    dropped = MetricsLogger(tmp_path / "dropped", total_steps=1, console="none")
    del dropped
    with step_timer(9), stage("train"):
        pass
    assert (tmp_path / "dropped" / "events.jsonl").read_text() == ""


# ------------------------------------------------------------------------------------------ Composer side
def _stream(url: str, run_id: str, last_id: str | None = None) -> list[tuple[str, str, dict]]:
    headers = {**AUTH, **({"Last-Event-ID": last_id} if last_id else {})}
    with httpx.Client(base_url=url, trust_env=False, timeout=30) as c:
        r = c.get(f"/api/runs/{run_id}/events?follow=0", headers=headers)
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields.get("id", ""), json.loads(fields["data"])))
    return out


def test_sse_streams_stage_events_in_order_and_resumes(grpo_run):
    srv, _ = start_in_thread(create_app(TOKEN, grpo_run.parent))
    try:
        first = _stream(srv.url, "grpo")
        stages = [(i, d) for e, i, d in first if e == "stage"]
        assert [d for _, d in stages] == _stages(grpo_run / "events.jsonl")  # every stage line, in file order
        ids = [Cursor.parse(i) for i, _ in stages]
        assert [c.events for c in ids] == sorted({c.events for c in ids})  # strictly increasing offsets
        assert ids[-1].events <= (grpo_run / "events.jsonl").stat().st_size  # (alarm rows may follow)
        # reconnect after the 5th stage line (step 2's generate): the remaining 7, once
        resumed = [d for e, _, d in _stream(srv.url, "grpo", last_id=stages[4][0]) if e == "stage"]
        assert [(d["step"], d["stage"]) for d in resumed] == [
            (2, "reward"), (2, "train"), (2, "sync"), (3, "generate"), (3, "reward"), (3, "train"), (3, "sync")]
        # an id from before events were tailed (three offsets) still parses: the stage lines come from the start
        assert Cursor.parse("1.2.3") == Cursor(1, 2, 3, 0)
        with pytest.raises(RunError, match="Last-Event-ID"):
            Cursor.parse("1.2.3.4.5")
        ended = [d for e, _, d in first if e == "status"][-1]
        assert ended["stage"] is None and ended["step"] == 3  # not running: no current stage
    finally:
        srv.stop()


def test_status_reports_the_trainers_stage_per_side(tmp_path):
    """A live run (a real process standing in for its pid): status takes the stage from events.jsonl."""
    manager = RunManager(tmp_path)
    run = tmp_path / "live"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # tokenmill"])
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd (before, its cmdline is pytest's)
        while b"tokenmill" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        now = time.time()
        (run / "composer.json").write_text(json.dumps({"id": "live", "mode": "rl", "pid": proc.pid,
                                                       "started": now - 5, "total_steps": 4}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "timing_s/generate": 100.0}) + "\n")
        before = manager.status_event("live")
        assert (before["stage"], before["stage_source"]) == ("generate", "estimated")
        lines = [{"event": "stage", "stage": "generate", "step": 1, "t": now - 60},  # an earlier launch's
                 {"event": "stage", "stage": "reward", "step": 3, "t": now - 2, "side": "producer"},
                 {"event": "stage", "stage": "train", "step": 2, "t": now - 1, "side": "trainer"},
                 {"event": "other"}]
        (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        got = manager.status_event("live")
        assert got["status"] == "running" and got["stage_source"] == "reported"
        assert (got["stage"], got["stage_step"]) == ("train", 2)
        assert got["sides"] == {"trainer": "train", "producer": "reward"}
        with open(run / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": "stage", "stage": "generate", "step": 4, "t": now, "side": "producer"})
                    + "\n")
        got = manager.status_event("live")
        assert (got["stage"], got["stage_step"], got["sides"]) == ("generate", 4,
                                                                   {"producer": "generate", "trainer": "train"})
    finally:
        proc.kill()
        proc.wait()
