"""Stop a run whose reward function fails on every sample, instead of training around it.

A failed score (a raise, a timeout, NaN, a wrong length) leaves the sample to the other rewards, which is
right for a flaky sample and wrong for a broken function: the run would go on, for as long as it is
configured, optimising whatever rewards remain. `RewardFailureWatch` counts, per function, the consecutive
steps in which it failed on all the samples it was asked to score, and stops the run after
`controller.reward_failure_steps` of them with one message naming the function and its first error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.types import Group, TokenmillError


class RewardFailureError(TokenmillError):
    """A reward function failed on every sample for `controller.reward_failure_steps` steps in a row."""


@dataclass
class _Streak:
    since: int  # the first step of the streak
    steps: int
    first_error: str


class RewardFailureWatch:
    """steps: consecutive all-failed steps that stop the run (0 never stops)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._streaks: dict[str, _Streak] = {}

    def check(self, step: int, groups: Iterable[Group]) -> None:
        """Record this step's scores; raise `RewardFailureError` when a streak reaches `steps`.

        A function fails a step when it gave no sample a value and at least one an error (samples it
        abstained on with None are not failures); any scored sample ends its streak."""
        if not self.steps:
            return
        samples = [s for g in groups for s in g.samples]
        names = dict.fromkeys(name for s in samples for name in s.rewards)  # in order of first use
        for name in names:
            errors = [s.reward_errors[name] for s in samples if name in s.reward_errors]
            scored = any(s.rewards.get(name) is not None for s in samples)
            if scored or not errors:
                self._streaks.pop(name, None)
            elif name in self._streaks:
                self._streaks[name].steps += 1
            else:
                self._streaks[name] = _Streak(since=step, steps=1, first_error=errors[0])
        for name, streak in self._streaks.items():
            if streak.steps >= self.steps:
                error = " ".join(streak.first_error.split())  # one line, whatever the exception's text
                raise RewardFailureError(
                    f"reward {name!r} failed on every sample in {streak.steps} consecutive steps "
                    f"({streak.since}-{step}); first error: {error}. Fix or remove the function "
                    "(controller.reward_failure_steps: 0 turns this check off)"
                )
