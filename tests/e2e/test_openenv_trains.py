"""GRPO end to end on an OpenEnv environment: a real OpenEnv server (OpenEnv's app factory, uvicorn on a
loopback port) named by `env.openenv.url`, a tiny real model, the real loop. The run trains on exactly the
returns the server computed, and the policy's weights move."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field
from safetensors.torch import load_file

from tokenmill.serving import start_in_thread

REWARDS: list[float] = []  # every step's reward, as the server computed it


class WriteAction(Action):
    text: str = Field(..., description="what the policy wrote")


class WriteObservation(Observation):
    feedback: str = ""


class Digits(Environment[WriteAction, WriteObservation, State]):
    """Two turns; each reply earns the share of its characters that are digits."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, **kwargs: Any) -> WriteObservation:
        self.steps = 0
        return WriteObservation(feedback=f"Write digits (game {seed}).")

    def step(self, action: WriteAction, **kwargs: Any) -> WriteObservation:
        self.steps += 1
        reward = sum(c.isdigit() for c in action.text) / max(1, len(action.text))
        REWARDS.append(reward)
        return WriteObservation(feedback=f"{reward:.2f}", reward=reward, done=self.steps >= 2)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


def test_grpo_trains_on_an_openenv_server(tiny_model_path, tmp_path):
    import tokenmill

    server, _ = start_in_thread(create_fastapi_app(Digits, WriteAction, WriteObservation, max_concurrent_envs=16),
                                websockets=True)
    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"path": "unused.jsonl", "num_eval": 0},
        "env": {"openenv": {"url": server.url, "action": "text", "observation": "feedback"},
                "max_turns": 4, "max_episode_tokens": 128, "max_concurrent": 16},
        "generation": {"group_size": 4, "max_tokens": 6},
        "training": {"learning_rate": 1e-2},
        "controller": {"steps": 3, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0},
    }
    try:
        result = tokenmill.train(cfg, dataset=[{"prompt": "Go.", "seed": s} for s in range(6)])
    finally:
        server.stop()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and result["last_metrics"]["reward/mean"] == steps[-1]["reward/mean"]
    assert all(r["agent/failed_episodes"] == 0 and r["train/sequences_trained"] == 8 for r in steps)
    # the run trained on the returns the server computed: 8 episodes a step, every reward counted once
    assert sum(r["reward/mean"] * 8 for r in steps) == pytest.approx(sum(REWARDS))
    assert 0 < sum(REWARDS) and any(r["reward/std"] > 0 for r in steps)  # returns that differ: a gradient
    trained = load_file(next((tmp_path / "run").rglob("final/*.safetensors")))
    initial = load_file(next(Path(tiny_model_path).glob("*.safetensors")))
    moved = [name for name, w in trained.items() if not torch.equal(w, initial[name])]
    assert moved and all(torch.isfinite(w).all() for w in trained.values())


@pytest.mark.slow
def test_grpo_on_the_example_openenv_game_raises_the_success_rate(tmp_path, monkeypatch):
    """examples/openenv_guess/config.yaml as `tokenmill train` runs it (the run serves the OpenEnv game on
    loopback), from the warm game player that prefers counting up to halving: the held-out success rate
    rises as on the built-in game (tests/e2e/test_agent_learns.py)."""
    import tokenmill
    from tokenmill.recipes import game_warm_start

    torch.set_num_threads(2)
    warm = game_warm_start(tmp_path / "game", sft_steps=300, say=lambda _: None)
    monkeypatch.chdir(Path(__file__).parents[2] / "examples" / "openenv_guess")
    result = tokenmill.train("config.yaml", model__path=str(warm), tracking__output_dir=str(tmp_path / "run"),
                             tracking__console="none", checkpoint__save_final=False)
    before, after = result["eval_before"], result["eval_after"]
    print(f"OpenEnv guess the number, held-out success: greedy {before['eval/accuracy']:.3f} -> "
          f"{after['eval/accuracy']:.3f}, sampled {before['eval/sampled_accuracy']:.3f} -> "
          f"{after['eval/sampled_accuracy']:.3f}")
    assert before["eval/accuracy"] < 0.6
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.3
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent/failed_episodes"] == 0 for r in rows if "reward/mean" in r)
