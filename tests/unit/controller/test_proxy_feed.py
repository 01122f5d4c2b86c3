"""Proxy mode is a feed of the one loop (`run_rl`): through `tokenmill.train` it trains on the agent's
episodes, trains the critic, keeps the KL out of the loss when it is in the reward, checkpoints, resumes,
evaluates and exports, like every other run. The agent is `examples/openai_agent/agent.py`, a plain
OpenAI-SDK program in a subprocess, playing against the real loopback endpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tokenmill

pytest.importorskip("openai")
AGENT = Path(__file__).parents[3] / "examples" / "openai_agent" / "agent.py"
GROUP, PROMPTS = 4, 2


def _config(model: str, out: Path, steps: int, games: int, **sections) -> dict:
    """A proxy run of `steps` steps whose agent plays `games` groups of GROUP games (seeded secrets)."""
    cfg = {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 50, "num_eval": 0},
        "generation": {"group_size": GROUP, "max_tokens": 4},
        "training": {"learning_rate": 1e-2},
        "controller": {"steps": steps, "prompts_per_step": PROMPTS},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
        "proxy": {"port": 0, "wait_timeout_s": 60, "agent_command": [
            sys.executable, str(AGENT), "--url", "{url}", "--games", str(games), "--group-size", str(GROUP),
            "--parallel", "8"]},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _train(cfg: dict) -> dict:
    return tokenmill.train(cfg)


def _steps(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def _checkpoints(out: Path) -> list[int]:
    """The steps of the complete checkpoints in the run folder."""
    return sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))


def test_the_python_api_trains_on_the_proxy_agents_episodes(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    _train(_config(tiny_model_path, out, steps=2, games=2 * PROMPTS))
    steps = _steps(out)
    assert [r["step"] for r in steps] == [1, 2]
    assert all("proxy/version_lag_max" in r and 0 <= r["proxy/version_lag_max"] <= 1 for r in steps)
    # the samples are the agent's games (its system message), not the addition rows of data.task
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"][0] == {"role": "system", "content": "guess"} for s in samples)


def test_a_proxy_run_trains_its_critic(tiny_model_path, tmp_path):
    out = tmp_path / "ppo"
    _train(_config(tiny_model_path, out, steps=2, games=2 * PROMPTS, algorithm={"advantage": "gae"},
                   critic={"warmup_steps": 0}))
    steps = _steps(out)
    assert len(steps) == 2
    # value_update's own metrics: its loss and its optimiser's learning rate (gae_advantages alone reports
    # critic/value_mean and critic/return_mean, never a loss or an lr)
    assert all("critic/value_loss" in r and r["critic/lr"] > 0 for r in steps)


def test_kl_in_the_reward_is_not_also_in_the_proxy_runs_loss(tiny_model_path, tmp_path):
    out = tmp_path / "kl"
    _train(_config(tiny_model_path, out, steps=1, games=PROMPTS, critic={"warmup_steps": 0},
                   algorithm={"advantage": "gae", "kl_in_reward": True, "kl_coef": 0.5, "ppo_epochs": 2}))
    [step] = _steps(out)
    # with the KL in the reward, `kl` is the sampler's (version 0) against the reference (the same weights):
    # zero up to float noise. Had the reference also gone into the loss, `kl` would be the loss's estimate
    # of the policy after its first epoch (lr 1e-2) against the reference, far from zero.
    assert abs(step["kl"]) < 1e-4


def test_a_proxy_run_checkpoints_resumes_evaluates_and_exports(tiny_model_path, tmp_path):
    out = tmp_path / "resume"
    first = _train(_config(tiny_model_path, out, steps=4, games=2 * PROMPTS,
                           controller={"max_steps_per_run": 2, "eval_every": 2}, data={"num_eval": 4},
                           checkpoint={"every": 1, "keep_last": 1}))
    assert first["resumed_from"] == 0 and "eval_before" in first and "eval_after" not in first
    assert _checkpoints(out) == [2]
    assert not (out / "final").exists()
    second = _train(_config(tiny_model_path, out, steps=4, games=2 * PROMPTS, data={"num_eval": 4},
                            controller={"eval_every": 2}, checkpoint={"resume": True}))
    assert second["resumed_from"] == 2 and second["eval_after"]["eval/rows"] == 4
    steps = _steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all("eval/accuracy" in r for r in steps if r["step"] % 2 == 0)
    # the final export is the model of the last checkpoint (step 4)
    assert _checkpoints(out)[-1] == 4
    final = load_file(str(out / "final" / "model.safetensors"))
    saved = load_file(str(out / "checkpoints" / f"step_{4:08d}" / "model.safetensors"))
    shared = final.keys() & saved.keys()  # a tied embedding is saved under one name or the other
    assert len(shared) >= len(final) - 1 and all(torch.equal(final[k], saved[k]) for k in shared)


def test_a_proxy_run_whose_agent_stops_early_ends_and_exports_what_it_trained(tiny_model_path, tmp_path):
    out = tmp_path / "short"
    result = _train(_config(tiny_model_path, out, steps=5, games=2 * PROMPTS))
    assert [r["step"] for r in _steps(out)] == [1, 2]
    assert result["last_metrics"]["proxy/version_lag_max"] >= 0
    assert (out / "final" / "model.safetensors").is_file() and _checkpoints(out) == [2]


def test_a_proxy_endpoint_off_loopback_without_a_token_is_refused_naming_the_fields(tiny_model_path, tmp_path):
    cfg = _config(tiny_model_path, tmp_path / "open", steps=1, games=PROMPTS, proxy={"host": "0.0.0.0"})
    with pytest.raises(tokenmill.types.TokenmillError, match=r"non-loopback host '0.0.0.0'.*proxy.allow_remote "
                       r"together with proxy.token"):
        _train(cfg)
