"""A weighted set of rewards: each scored on its own (and logged), then summed with weights.

A reward that gives a sample no score abstains, and how depends on why. None means "does not apply" (as in
TRL): the reward adds nothing to that sample's total. A failure (a raise, a timeout, a wrong value) means
"unknown": the reward counts, for that sample, as the mean of what it scored on the rest of the sample's
group, so a sample is neither penalised nor favoured against its group because a function failed on it (a
failed format reward must not rank a wrong answer below another wrong answer). A sample no reward scored
has total NaN and is left out of training.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tokenmill.rewards.base import Reward, RewardState
from tokenmill.tracking import events
from tokenmill.types import RewardResult

ERRORS_KEPT = 5  # distinct error texts of one reward written to events.jsonl per batch


def totals(
    per_sample: list[dict[str, RewardResult]], weights: dict[str, float], group_ids: Sequence[int] | None = None
) -> list[float]:
    """total_i = sum_k w_k * r_k,i over the rewards that scored sample i, where a reward that failed on i
    (an error, not None) counts as its mean over the samples it scored in i's group (`group_ids`: one id per
    sample; None: one group); NaN where no reward scored sample i."""
    groups = list(group_ids) if group_ids is not None else [0] * len(per_sample)
    scored: dict[tuple[str, int], list[float]] = {}
    for slot, g in zip(per_sample, groups, strict=True):
        for name, r in slot.items():
            if r.value is not None:
                scored.setdefault((name, g), []).append(r.value)
    out = []
    for slot, g in zip(per_sample, groups, strict=True):
        terms = [weights[name] * r.value for name, r in slot.items() if r.value is not None]
        if not terms:
            out.append(math.nan)
            continue
        for name, r in slot.items():
            peers = scored.get((name, g))
            if r.value is None and r.error is not None and peers:
                terms.append(weights[name] * math.fsum(peers) / len(peers))
        out.append(math.fsum(terms))
    return out


def report_failures(name: str, results: list[RewardResult], step: int) -> None:
    """One `reward_failed` line in the run's events.jsonl: how many samples failed and the commonest errors."""
    errors = Counter(r.error for r in results if r.error is not None)
    if errors:
        events.emit("reward_failed", reward=name, version=step, failed=sum(errors.values()), samples=len(results),
                    errors=[{"error": e[:500], "samples": c} for e, c in errors.most_common(ERRORS_KEPT)])


class RewardSet:
    """Scores with every reward and sums them with weights (see `totals` for samples a reward did not score).

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
        # one scorer at a time: an async run's producer scores rollouts while the trainer may score a held-out
        # evaluation, and a forked reward worker serves one request at a time
        self._score_lock = threading.Lock()

    def score(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        step: int = 0,
        group_ids: Sequence[int] | None = None,
    ) -> tuple[list[float], list[dict[str, RewardResult]]]:
        """Score every completion with every reward. step: the policy version that generated them (reward
        functions see it as `trainer_state.global_step`); group_ids: the group of each completion (a failed
        score is imputed within its group). Failures are written to the run's events.jsonl."""
        with self._score_lock:
            return self._score(prompts, completions, columns, completion_ids, step, group_ids)

    def _score(self, prompts, completions, columns, completion_ids, step, group_ids):
        state = RewardState(global_step=step, max_steps=self.max_steps)
        per_sample: list[dict[str, RewardResult]] = [{} for _ in completions]
        for reward in self.rewards:
            start = time.perf_counter()
            results = reward(prompts, completions, columns, completion_ids=completion_ids, state=state)
            self.last_seconds[reward.name] = time.perf_counter() - start
            for slot, result in zip(per_sample, results, strict=True):
                slot[reward.name] = result
            report_failures(reward.name, results, step)
            log = getattr(reward, "last_log", None)
            with self._logged_lock:
                for name, values in (log.metrics.items() if log is not None else ()):
                    self._logged.setdefault(name, []).extend(values)
        return totals(per_sample, {r.name: r.weight for r in self.rewards}, group_ids), per_sample

    def drain_metrics(self) -> dict[str, float]:
        """The mean of each metric reward functions reported through `log_metric` since the last drain, as
        `reward_metric/<name>`."""
        with self._logged_lock:
            logged, self._logged = self._logged, {}
        return {f"reward_metric/{name}": statistics.fmean(values) for name, values in logged.items() if values}

    def close(self) -> None:
        for reward in self.rewards:
            reward.close()
