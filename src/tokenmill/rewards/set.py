"""A weighted set of rewards: each scored on its own (and logged), then summed with weights."""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any

from tokenmill.rewards.base import Reward, RewardState
from tokenmill.types import RewardResult


class RewardSet:
    """total_i = sum_k w_k * r_k,i over the rewards that scored sample i; NaN if none did.

    max_steps is what reward functions see as `trainer_state.max_steps` (the run's `controller.steps`)."""

    def __init__(self, rewards: list[Reward], max_steps: int = 0) -> None:
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        self.rewards = rewards
        self.max_steps = max_steps
        self.last_seconds: dict[str, float] = {}
        self._logged: dict[str, list[float]] = {}
        self._logged_lock = threading.Lock()  # an async run scores in the producer and drains in the trainer

    def score(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        step: int = 0,
    ) -> tuple[list[float], list[dict[str, RewardResult]]]:
        """Score every completion with every reward. step: the policy version that generated them (reward
        functions see it as `trainer_state.global_step`)."""
        state = RewardState(global_step=step, max_steps=self.max_steps)
        per_sample: list[dict[str, RewardResult]] = [{} for _ in completions]
        for reward in self.rewards:
            start = time.perf_counter()
            results = reward(prompts, completions, columns, completion_ids=completion_ids, state=state)
            self.last_seconds[reward.name] = time.perf_counter() - start
            for slot, result in zip(per_sample, results, strict=True):
                slot[reward.name] = result
            log = getattr(reward, "last_log", None)
            with self._logged_lock:
                for name, values in (log.metrics.items() if log is not None else ()):
                    self._logged.setdefault(name, []).extend(values)
        weights = {r.name: r.weight for r in self.rewards}
        totals = []
        for slot in per_sample:
            scored = [weights[k] * r.value for k, r in slot.items() if r.value is not None]
            totals.append(math.fsum(scored) if scored else math.nan)
        return totals, per_sample

    def drain_metrics(self) -> dict[str, float]:
        """The mean of each metric reward functions reported through `log_metric` since the last drain, as
        `reward_metric/<name>`."""
        with self._logged_lock:
            logged, self._logged = self._logged, {}
        return {f"reward_metric/{name}": statistics.fmean(values) for name, values in logged.items() if values}

    def close(self) -> None:
        for reward in self.rewards:
            reward.close()
