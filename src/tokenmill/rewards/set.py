"""A weighted set of rewards: each scored on its own (and logged), then summed with weights."""

from __future__ import annotations

import math
import time
from typing import Any

from tokenmill.rewards.base import Reward
from tokenmill.types import RewardResult


class RewardSet:
    """total_i = sum_k w_k * r_k,i over the rewards that scored sample i; NaN if none did."""

    def __init__(self, rewards: list[Reward]) -> None:
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        self.rewards = rewards
        self.last_seconds: dict[str, float] = {}

    def score(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> tuple[list[float], list[dict[str, RewardResult]]]:
        per_sample: list[dict[str, RewardResult]] = [{} for _ in completions]
        for reward in self.rewards:
            start = time.perf_counter()
            results = reward(prompts, completions, columns)
            self.last_seconds[reward.name] = time.perf_counter() - start
            for slot, result in zip(per_sample, results, strict=True):
                slot[reward.name] = result
        weights = {r.name: r.weight for r in self.rewards}
        totals = []
        for slot in per_sample:
            scored = [weights[k] * r.value for k, r in slot.items() if r.value is not None]
            totals.append(math.fsum(scored) if scored else math.nan)
        return totals, per_sample

    def close(self) -> None:
        for reward in self.rewards:
            reward.close()
