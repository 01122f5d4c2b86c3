"""Health alarms on real runs of the tiny model: a constant reward trips the flat-groups alarm within 5 steps
(a warning that lets the run go on, or a stop that saves a checkpoint and exits 1 with the message); max_tokens
1 on addition trips the truncation alarm; the efficiency report lands in report.json and events.jsonl."""

from __future__ import annotations

import json

import yaml

import tokenmill

CONSTANT = '''
def constant(prompts, completions, **kwargs):
    return [0.5] * len(completions)
'''


def _config(tmp_path, model: str, **sections) -> dict:
    (tmp_path / "rewards.py").write_text(CONSTANT)
    cfg = {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 100, "num_eval": 0},
        "rewards": [{"function": f"{tmp_path / 'rewards.py'}:constant"}],
        "generation": {"group_size": 2, "max_tokens": 3},
        "controller": {"steps": 6, "prompts_per_step": 4},
        "engine": {"threads": 1},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    for key, value in sections.items():
        cfg[key] = cfg.get(key, {}) | value
    return cfg


def _events(tmp_path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == kind]


def test_a_constant_reward_warns_flat_groups_at_step_5_and_the_run_goes_on(tiny_model_path, tmp_path):
    result = tokenmill.train(_config(tmp_path, tiny_model_path))
    alarms = [a for a in _events(tmp_path, "alarm") if a["name"] == "flat_groups"]  # (the random model also
    assert [(a["step"], a["policy"]) for a in alarms] == [(5, "warn")]  # runs into max_tokens: truncation)
    assert alarms[0]["metric"] == "groups/zero_variance_fraction" and alarms[0]["value"] == 1.0
    assert alarms[0]["message"].startswith("all 4 groups scored the same for 5 steps")
    assert "use algorithm.dynamic_sampling" in alarms[0]["message"]
    assert result["last_metrics"]["groups/zero_variance_fraction"] == 1.0  # step 6 ran
    # the efficiency report: each step's efficiency/* and one summary of the run
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == 5 and report["mode"] == "sync"  # step 1 (warm-up) left out
    assert abs(sum(report["shares"].values()) - 1.0) < 1e-6
    assert 0 < report["ideal_s"] <= report["step_s"] and report["advice"]
    assert _events(tmp_path, "efficiency_report")[0]["advice"] == report["advice"]
    assert 0 < result["last_metrics"]["efficiency/ratio"] <= 1


def test_a_stop_alarm_saves_a_checkpoint_and_exits_1_with_the_message(tiny_model_path, tmp_path, capsys):
    from tokenmill.cli import main

    cfg = _config(tmp_path, tiny_model_path, health={"alarms": {"flat_groups": {"policy": "stop", "window": 3}}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["train", str(tmp_path / "config.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("tokenmill: all 4 groups scored the same for 3 steps (groups/zero_variance_fraction 1 >= "
                              "threshold 1): ")
    assert not any("Traceback" in line for line in err)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000003"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # stopped after the step that fired
    assert ("flat_groups", "stop", 3) in [(a["name"], a["policy"], a["step"]) for a in _events(tmp_path, "alarm")]


def test_max_tokens_1_on_addition_trips_the_truncation_alarm(tiny_model_path, tmp_path):
    cfg = _config(tmp_path, tiny_model_path, generation={"max_tokens": 1}, controller={"steps": 3})
    cfg["rewards"] = []  # the addition task's own verifier
    tokenmill.train(cfg)
    alarms = {a["name"]: a for a in _events(tmp_path, "alarm")}
    assert alarms["truncation"]["step"] == 3  # the default window: 3 steps
    assert alarms["truncation"]["value"] == 1.0
    assert alarms["truncation"]["message"].startswith(
        "100% of completions were cut at generation.max_tokens (1) for 3 steps")


def test_an_engine_sampling_at_another_temperature_trips_the_mismatch_alarm_naming_it(tiny_model_path, tmp_path):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl
    from tokenmill.testing.health import shift_temperature

    def run_at(temperature: float, out: str) -> tuple[dict, list[dict]]:
        # the random tiny model's logits are nearly flat, so a temperature moves its logprobs little: 1.5 against
        # 1.0 gives a KL of ~6e-4 per token (a real model's peaked distributions move far more)
        cfg = _config(tmp_path, tiny_model_path, health={"alarms": {"mismatch": {"threshold": 2e-4, "window": 2}}})
        cfg["tracking"]["output_dir"] = str(tmp_path / out)
        cfg["controller"]["steps"] = 3
        run = build_run(load_config(RLConfig, cfg))
        shift_temperature(run, temperature)
        try:
            result = run_rl(run)
        finally:
            run.close()
        rows = [json.loads(x) for x in (tmp_path / out / "events.jsonl").read_text().splitlines()]
        return result, [r for r in rows if r["event"] == "alarm" and r["name"] == "mismatch"]

    result, alarms = run_at(1.0, "same")  # the in-process fp32 engine agrees with the trainer exactly
    assert result["last_metrics"]["mismatch/kl"] <= 1e-6 and alarms == []
    result, [alarm] = run_at(1.5, "shifted")
    assert alarm["step"] == 2 and alarm["metric"] == "mismatch/kl" and alarm["value"] >= 2e-4
    assert ("likely causes: the engine samples at temperature 1.5 but the trainer assumes generation.temperature 1: "
            "make them equal") in alarm["message"]


def test_nan_updates_are_skipped_with_an_alarm_each_and_the_third_in_a_row_stops(tiny_model_path, tmp_path,
                                                                                  monkeypatch):
    """`tokenmill train` with a loss gone NaN: the trainer applies none of those updates, each step is a
    `skipped_update` alarm naming the NaN, and the third in a row ends the run (health.alarms.skipped_update)."""
    import math

    import pytest

    from tokenmill.health.alarms import AlarmStop
    from tokenmill.training.local import LocalBackend

    original = LocalBackend.forward_backward
    seen: list[float] = []

    def poisoned(self, batch, loss_fn, entropy_coef=0.0):
        def nan_loss(logprobs_B_T, micro):
            loss, metrics = loss_fn(logprobs_B_T, micro)
            return loss * math.nan, metrics

        seen.append(sum(float(p.detach().double().sum()) for p in self.params))  # the weights never move
        return original(self, batch, nan_loss, entropy_coef)

    monkeypatch.setattr(LocalBackend, "forward_backward", poisoned)
    with pytest.raises(AlarmStop, match=r"^step 3 skipped its update: loss was NaN.*3 in a row: the run stops"):
        tokenmill.train(_config(tmp_path, tiny_model_path))
    alarms = [(a["step"], a["name"], a["policy"]) for a in _events(tmp_path, "alarm") if a["name"] == "skipped_update"]
    assert alarms == [(1, "skipped_update", "warn"), (2, "skipped_update", "warn"), (3, "skipped_update", "stop")]
    assert len(seen) >= 3 and len(set(seen)) == 1 and math.isfinite(seen[0])
