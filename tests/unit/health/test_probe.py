"""The weight-sync probe: an engine that missed an update is caught, in process and on a real `tokenmill serve`
subprocess whose weight sync drops one push (only the sync is a double; engine and trainer are real)."""

from __future__ import annotations

import copy
import json

import torch

import tokenmill
from tokenmill.engines import HFEngine
from tokenmill.health.probe import WeightProbe, probe_gap, probe_sequence, tolerance_for
from tokenmill.testing.crash import REWARD
from tokenmill.testing.health import drop_pushes


def test_the_probe_is_fixed_and_the_tolerance_follows_the_dtype():
    assert probe_sequence(100, 32) == probe_sequence(100, 32)
    assert len(probe_sequence(100, 32)) == 32 and all(0 <= t < 100 for t in probe_sequence(100, 32))
    assert tolerance_for(torch.float32, None) == 1e-4 and tolerance_for(torch.bfloat16, None) > 1e-2
    assert tolerance_for(torch.bfloat16, 0.5) == 0.5


def test_an_engine_that_missed_an_update_is_caught_until_it_gets_it(tiny_model, tokenizer):
    engine = HFEngine(copy.deepcopy(tiny_model), tokenizer)
    probe = probe_sequence(tiny_model.config.vocab_size, 32)
    assert probe_gap(engine, tiny_model, probe) <= 1e-6
    with torch.no_grad():  # the trainer takes a step the engine does not see
        for p in tiny_model.parameters():
            p.add_(1e-2 * torch.randn_like(p))
    missed = probe_gap(engine, tiny_model, probe)
    assert missed > 1e-3
    engine.update_weights(tiny_model.named_parameters(), version=1)
    assert probe_gap(engine, tiny_model, probe) <= 1e-6


def test_the_colocated_engine_shares_the_module_and_every_nth_push_is_probed(tiny_model_path, tmp_path):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run
    from tokenmill.controller.feeds import InlineFeed

    cfg = load_config(RLConfig, {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
                                 "health": {"probe_every": 2}, "tracking": {"output_dir": str(tmp_path),
                                                                            "console": "none"}})
    run = build_run(cfg)
    try:
        probe = WeightProbe(run, InlineFeed(run, None), say=print)
        assert probe.engine is run.rollout.engine and probe.tolerance == 1e-4
        assert probe.after_push(1) == {}
        assert probe.after_push(2) == {"probe/max_abs": 0.0, "probe/ok": 1.0}
    finally:
        run.close()


def train_on_a_server(model_path: str, tmp_path, steps: int, max_staleness: int = 0) -> None:
    """A short GRPO run on a `tokenmill serve` process (files sync), dense reward, probe alarm warning only
    (stop would end the run at the first failed probe)."""
    tokenmill.train({
        "model": {"path": model_path},
        "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "rewards": [{"function": f"{tmp_path / 'rewards.py'}:digit_share"}],
        "generation": {"group_size": 4, "max_tokens": 4},
        "training": {"learning_rate": 1e-2},
        "controller": {"steps": steps, "prompts_per_step": 4, "max_staleness": max_staleness},
        "engine": {"placement": "process", "sync": "files", "threads": 1},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
        "health": {"alarms": {"probe": {"policy": "warn"}}},
    })


def test_a_dropped_push_to_a_server_process_fails_the_probe_at_that_step(tiny_model_path, tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(REWARD)  # dense: every step changes the weights
    made = drop_pushes(monkeypatch, {2})
    train_on_a_server(tiny_model_path, tmp_path, steps=3)
    assert [d.dropped for d in made] == [[2]]
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if "probe/ok" in r}
    assert [rows[s]["probe/ok"] for s in (1, 2, 3)] == [1.0, 0.0, 1.0]
    assert rows[1]["probe/max_abs"] <= 1e-4 and rows[3]["probe/max_abs"] <= 1e-4
    assert rows[2]["probe/max_abs"] > 1e-3


def test_beside_a_producer_running_ahead_the_probe_runs_in_the_background_and_still_catches_a_lost_sync(
        tiny_model_path, tmp_path, monkeypatch):
    """max_staleness 1 on a server: the probe's scoring waits for the server's batch in flight, so it runs
    in a thread and reports at a later step, naming the push it checked (probe/step). Every push from step 3
    on is dropped: the probes of those pushes fail, the earlier ones pass."""
    (tmp_path / "rewards.py").write_text(REWARD)
    made = drop_pushes(monkeypatch, set(range(3, 20)))
    train_on_a_server(tiny_model_path, tmp_path, steps=8, max_staleness=1)
    assert [d.dropped for d in made] == [list(range(3, 9))]
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if "probe/ok" in r]
    checked = {int(r["probe/step"]): r for r in rows}
    assert all(r["step"] > r["probe/step"] for r in rows)  # reported after the push it checked
    passed = [s for s in checked if s < 3]
    failed = [s for s in checked if s >= 3]
    assert passed and failed, f"probes that came back: {sorted(checked)}"
    assert all(checked[s]["probe/ok"] == 1.0 and checked[s]["probe/max_abs"] <= 1e-4 for s in passed)
    assert all(checked[s]["probe/ok"] == 0.0 and checked[s]["probe/max_abs"] > 1e-3 for s in failed)
