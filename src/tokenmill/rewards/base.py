"""Rewards: TRL-style functions unchanged, reward models, and a weighted set of both.

A reward function has TRL's batched signature and may abstain with None:

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

Every call is timed out, and whatever a function does wrong (raise, hang, return the wrong length, NaN,
a string) becomes a failed score (`RewardResult(None, error=...)`) that is counted and logged.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenmill.rewards.isolation import CallFailed, CallTimeout, make_caller
from tokenmill.types import RewardResult


class Reward(Protocol):
    """Scores a batch of completions. `columns` holds the dataset columns of each row, batched."""

    name: str
    weight: float

    def __call__(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> list[RewardResult]: ...


def _check_value(v: Any) -> RewardResult:
    if v is None:
        return RewardResult(None)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)  # numpy / torch scalars
        except (TypeError, ValueError):
            return RewardResult(None, f"not a number: {v!r:.60}")
    if math.isnan(v) or math.isinf(v):
        return RewardResult(None, f"non-finite value {v}")
    return RewardResult(float(v))


class FunctionReward:
    """A Python reward function run under a timeout (in a forked worker by default)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        weight: float = 1.0,
        timeout_s: float = 10.0,
        per_sample: bool = False,
        isolation: str = "process",
    ) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.weight = weight
        self.timeout_s = timeout_s
        self.per_sample = per_sample
        params = inspect.signature(fn).parameters.values()
        self._takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._accepted = {p.name for p in params}
        self._call = make_caller(_per_sample_batch(fn) if per_sample else fn, isolation)

    def _kwargs(self, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self._takes_all:
            return columns
        return {k: v for k, v in columns.items() if k in self._accepted}

    def __call__(
        self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]]
    ) -> list[RewardResult]:
        n = len(completions)
        try:
            out = self._call(prompts, completions, timeout=self.timeout_s, **self._kwargs(columns))
        except (CallTimeout, CallFailed) as exc:
            return [RewardResult(None, str(exc))] * n
        if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
            try:
                out = list(out)  # numpy arrays, tensors
            except TypeError:
                return [RewardResult(None, f"returned {type(out).__name__}, expected a list")] * n
        if len(out) != n:
            return [RewardResult(None, f"returned {len(out)} values for {n} completions")] * n
        return [_check_value(v) for v in out]

    def close(self) -> None:
        self._call.close()


def _per_sample_batch(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
    """Adapt fn(prompt, completion, **row) -> value to the batched signature."""

    def batched(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[Any]:
        columns = {k: v for k, v in columns.items() if k not in ("prompt", "completion")}
        return [
            fn(p, c, **{k: v[i] for k, v in columns.items()})
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]

    return batched
