"""Catch a reward function that fails on (nearly) every sample, instead of training around it.

A failed score (a raise, a timeout, NaN, a wrong length) leaves the sample to the other rewards, which is
right for a flaky sample and wrong for a broken function: the run would go on, for as long as it is
configured, optimising whatever rewards remain. `RewardFailureWatch` counts, per function, the consecutive
steps in which it failed on at least `threshold` of the samples it was asked to score (1.0: all of them), and
reports a streak of `steps` of them with one message naming the function and its first error. It is the
`reward_failures` alarm of `health.alarms` (`tokenmill.health.alarms`), which stops the run by default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.types import Group, TokenmillError

OFF_HINT = "health.alarms.reward_failures.policy: off turns this check off"


class RewardFailureError(TokenmillError):
    """A reward function failed on every sample (or on `threshold` of them) for `window` steps in a row."""


@dataclass
class _Streak:
    since: int  # the first step of the streak
    steps: int
    first_error: str
    share: float  # the failed share of the latest step


@dataclass(frozen=True)
class Failing:
    """One function whose streak reached the window: its name, failed share of the last step, and message."""

    name: str
    share: float
    message: str


class RewardFailureWatch:
    """steps: consecutive failed steps that make a streak worth reporting (0 never reports); threshold: the
    share of a function's scored-or-failed samples that must have failed for a step to count."""

    def __init__(self, steps: int, threshold: float = 1.0) -> None:
        self.steps, self.threshold = steps, threshold
        self._streaks: dict[str, _Streak] = {}

    def failing(self, step: int, groups: Iterable[Group]) -> list[Failing]:
        """Record this step's scores; return the functions whose streak is `steps` long or longer.

        A function fails a step when the samples it failed on are at least `threshold` of those it scored or
        failed on (samples it abstained on with None count for neither); with threshold 1.0 that is: it gave
        no sample a value and at least one an error."""
        if not self.steps:
            return []
        samples = [s for g in groups for s in g.samples]
        names = dict.fromkeys(name for s in samples for name in s.rewards)  # in order of first use
        for name in names:
            errors = [s.reward_errors[name] for s in samples if name in s.reward_errors]
            scored = sum(s.rewards.get(name) is not None for s in samples)
            share = len(errors) / max(1, len(errors) + scored)
            if not errors or share < self.threshold:
                self._streaks.pop(name, None)
            elif name in self._streaks:
                self._streaks[name].steps += 1
                self._streaks[name].share = share
            else:
                self._streaks[name] = _Streak(since=step, steps=1, first_error=errors[0], share=share)
        return [Failing(name, streak.share, self._message(name, streak, step))
                for name, streak in self._streaks.items() if streak.steps >= self.steps]

    def _message(self, name: str, streak: _Streak, step: int) -> str:
        error = " ".join(streak.first_error.split())  # one line, whatever the exception's text
        what = ("every sample" if self.threshold >= 1.0 else
                f"{streak.share:.0%} of its samples (threshold {self.threshold:.0%})")
        return (f"reward {name!r} failed on {what} in {streak.steps} consecutive steps ({streak.since}-{step}); "
                f"first error: {error}. Fix or remove the function ({OFF_HINT})")

    def check(self, step: int, groups: Iterable[Group]) -> None:
        """`failing`, raising `RewardFailureError` with the first streak's message."""
        found = self.failing(step, groups)
        if found:
            raise RewardFailureError(found[0].message)
