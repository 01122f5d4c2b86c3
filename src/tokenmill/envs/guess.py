"""Guess the number: a multi-turn game with feedback, small enough for the tiny test model.

The environment hides a number in [1, high]; each assistant turn is a guess, answered "higher", "lower" or
(done, reward 1) "correct". With `high = 2**max_turns - 1`, halving the interval always wins within `max_turns`
guesses, while guessing at random within the interval the feedback allows often does not; so the success
rate measures whether the policy uses the feedback well. Anything that is not a number in range is answered
with a reminder (and uses up the turn).
"""

from __future__ import annotations

import random
import re
from typing import Any

from tokenmill.envs.base import Message, StepResult

SYSTEM = "guess"


def guess_prompt(high: int) -> str:
    return f"1-{high}"


class GuessNumberEnv:
    """One episode of the game; the task row holds `secret` and `high` (see `guess_number_tasks`)."""

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns
        self.secret = 0
        self.high = 0
        self.turns = 0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.secret, self.high, self.turns = int(task["secret"]), int(task["high"]), 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": guess_prompt(self.high)}]

    def step(self, message: Message) -> StepResult:
        self.turns += 1
        last_turn = self.turns >= self.max_turns
        found = re.fullmatch(r"\s*(\d{1,3})\s*", message.get("content") or "")
        if found is None or not 1 <= int(found.group(1)) <= self.high:
            return StepResult([{"role": "user", "content": f"1-{self.high}?"}], 0.0, last_turn, {"valid": False})
        guess = int(found.group(1))
        if guess == self.secret:
            return StepResult([], 1.0, True, {"solved": True, "turns": self.turns})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": hint}], 0.0, last_turn, {"solved": False})

    def close(self) -> None:
        pass


def guess_number_tasks(n: int, seed: int = 0, high: int = 7):
    """`n` games with secrets uniform in [1, high]. Columns: prompt (the first user message), secret, high."""
    from datasets import Dataset

    rng = random.Random(seed)
    secrets = [rng.randint(1, high) for _ in range(n)]
    return Dataset.from_dict({"prompt": [guess_prompt(high)] * n, "secret": secrets, "high": [high] * n})


def guess_demonstration(secret: int, high: int, max_turns: int, rng: random.Random, bisect: float) -> list[Message]:
    """A played game for supervised warm starts: each guess is the interval's midpoint with probability
    `bisect`, else the lowest number the feedback still allows (a sloppy but legal player who counts up). A
    model warm-started on it knows both moves and prefers the slow one where `bisect` < 0.5."""
    lo, hi = 1, high
    chat: list[Message] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": guess_prompt(high)}]
    for turn in range(max_turns):
        guess = (lo + hi) // 2 if rng.random() < bisect else lo
        chat.append({"role": "assistant", "content": str(guess)})
        if guess == secret or turn == max_turns - 1:
            break
        if guess < secret:
            lo = guess + 1
            chat.append({"role": "user", "content": "higher"})
        else:
            hi = guess - 1
            chat.append({"role": "user", "content": "lower"})
    return chat
