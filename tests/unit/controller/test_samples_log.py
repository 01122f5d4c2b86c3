"""samples.jsonl records the advantage each sample trained with (logged after advantages are assigned)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import tokenmill

GROUP, PROMPTS = 4, 2


def char_code(prompts, completions, **_):
    """Dense, so samples inside a group differ (whatever the untrained model writes): the completion's
    character codes summed, modulo 101, scaled to [0, 1]."""
    return [sum(map(ord, c)) % 101 / 100 for c in completions]


def _run(model: str, out, **algorithm) -> list[dict]:
    torch.set_num_threads(1)
    tokenmill.train({
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 50, "num_eval": 0, "task_reward_weight": 0.0},
        "generation": {"group_size": GROUP, "max_tokens": 6},
        "algorithm": algorithm,
        "training": {"seed": 1},
        "controller": {"steps": 1, "prompts_per_step": PROMPTS},
        "tracking": {"output_dir": str(out), "console": "none", "log_samples": GROUP * PROMPTS},
        "checkpoint": {"save_final": False},
    }, rewards=[char_code])
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_logged_advantages_are_the_grpo_advantages_of_the_logged_rewards(tiny_model_path, tmp_path):
    records = _run(tiny_model_path, tmp_path / "grpo")
    assert len(records) == GROUP * PROMPTS
    groups = [records[i : i + GROUP] for i in range(0, len(records), GROUP)]
    assert any(len({r["reward"] for r in g}) > 1 for g in groups)  # some group has a spread to learn from
    for g in groups:
        rewards = [r["reward"] for r in g]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)  # GRPO: unbiased std, eps 1e-4
        for r in g:
            assert r["advantage"] == pytest.approx((r["reward"] - mean) / (std + 1e-4), abs=1e-9)
    assert any(r["advantage"] != 0.0 for r in records)


def test_with_a_critic_the_logged_advantage_is_the_mean_token_advantage(tiny_model_path, tmp_path):
    records = _run(tiny_model_path, tmp_path / "gae", advantage="gae")
    # GAE with the untrained critic's values: a non-zero advantage for every scored sample
    assert all(math.isfinite(r["advantage"]) for r in records)
    assert sum(r["advantage"] != 0.0 for r in records) >= GROUP
