"""GRPO with an LLM judge as a reward, end to end: a tiny policy, a tiny judge model served by tokenmill's OpenAI
app on loopback, an asynchronous run (generation one version ahead, rewards scored on the rollout side) with an
`async def` reward function beside the judge."""

from __future__ import annotations

import asyncio
import json
import math

import torch

import tokenmill


async def digit_share(completions, **_):
    await asyncio.sleep(0)  # a coroutine reward, awaited by the reward worker
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_async_grpo_with_a_judge_reward_runs_end_to_end(tiny_model_path, echo_judge, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    judge = {"type": "judge", "url": echo_judge, "model": "echo", "prompt": "{completion}", "score_pattern": r"(\d)",
             "score_range": [0, 9], "cache": "disk", "concurrency": 4}
    result = tokenmill.train({
        "model": {"path": tiny_model_path},
        "data": {"task": "addition", "num_train": 64, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "controller": {"steps": 3, "prompts_per_step": 4, "max_staleness": 1},
        "engine": {"placement": "thread", "threads": 1},
        "rewards": [judge],
        "tracking": {"output_dir": str(out), "console": "none"},
    }, rewards=[digit_share])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3 and result["last_metrics"]["reward_metric/judge/requests"] == steps[-1][
        "reward_metric/judge/requests"]
    # generation ran a version ahead, and the rewards (the judge's requests) were scored by the rollout producer
    assert all(r["async/staleness_max"] <= 1 and r["async/producer_reward_s"] > 0 for r in steps)
    asked = sum(r["reward_metric/judge/requests"] for r in steps)
    assert asked > 0 and all(r["reward_metric/judge/failed"] == 0 for r in steps)
    assert all(r["reward/digit_share/failed"] == 0 for r in steps)
    judged = [r["reward/judge/mean"] for r in steps if math.isfinite(r.get("reward/judge/mean", math.nan))]
    assert all(0.0 <= v <= 1.0 for v in judged)
    cached = (out / "judge_cache" / "judge.jsonl").read_text().splitlines()
    assert len(cached) == asked  # every answered request is on disk, none asked twice
