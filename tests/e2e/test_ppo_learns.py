"""PPO with a critic really improves a model: classic RLHF-style PPO (one sample per prompt, a value model,
GAE, KL to the reference in the reward, a critic warm-up) on the quickstart's warm model and task."""

from __future__ import annotations

import json

import torch

from tokenmill.recipes import grpo

PPO = {
    "algorithm.advantage": "gae", "generation.group_size": 1, "prompts_per_step": 128,
    "algorithm.kl_coef": 0.05, "algorithm.kl_in_reward": True, "critic.warmup_steps": 5,
}


def test_ppo_with_critic_raises_heldout_greedy_accuracy(warm, tmp_path):
    torch.set_num_threads(2)
    result = grpo(warm, tmp_path, steps=150, num_eval=500, eval_every=0, console="none", say=lambda _: None, **PPO)
    before, after = result["eval_before"]["eval/accuracy"], result["eval_after"]["eval/accuracy"]
    print(f"PPO held-out greedy accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.15, (before, after)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    # the critic trained every step and came to explain part of the returns; the policy waited for it
    assert all("critic/value_loss" in r for r in steps)
    assert max(r["critic/explained_variance"] for r in steps[-30:]) > 0.1
    assert all("train/optimizer_steps" not in r for r in steps[:5])
    assert all(r["train/optimizer_steps"] == 1 for r in steps[5:])
    # KL to the reference was measured (it is in the reward) and stayed small
    assert 0 < steps[-1]["kl"] < 1.0
