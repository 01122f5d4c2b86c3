"""A `gymnasium` environment as a text environment: observations become user messages, the policy's message
becomes the action.

Observations are the environment's ANSI render (highlighted cells as `[x]`) when it has one (`render_mode="ansi"`, e.g. FrozenLake,
Taxi, CliffWalking), else `str(observation)`. Actions: for a `Discrete` space the last integer in the message
(an action name from `action_names` works too); for a `Text` space the message itself. An action that cannot
be read is answered with the valid choices and costs a turn, but does not step the environment. The task row
gives the reset seed (`{"seed": 3}`); rewards are the environment's, per step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tokenmill.envs.base import Message, StepResult

FROZEN_LAKE_ACTIONS = ("left", "down", "right", "up")
_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m([^\x1b]+?)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class GymTextEnv:
    """`GymTextEnv("FrozenLake-v1", {"is_slippery": False}, action_names=FROZEN_LAKE_ACTIONS)`."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, *, max_turns: int = 50,
                 action_names: Sequence[str] | None = None, instructions: str | None = None) -> None:
        import gymnasium

        self.env = gymnasium.make(env_id, **{"render_mode": "ansi", **(env_kwargs or {})})
        self.discrete = isinstance(self.env.action_space, gymnasium.spaces.Discrete)
        self.text = isinstance(self.env.action_space, gymnasium.spaces.Text)
        if not (self.discrete or self.text):
            raise ValueError(f"{env_id}: only Discrete or Text action spaces can be written as text, "
                             f"not {type(self.env.action_space).__name__}")
        self.names = [n.lower() for n in action_names] if action_names else []
        if self.discrete and self.names and len(self.names) != self.env.action_space.n:
            raise ValueError(f"{env_id}: {len(self.names)} action_names for {self.env.action_space.n} actions")
        self.env_id, self.max_turns, self.turns = env_id, max_turns, 0
        self.instructions = instructions or self._default_instructions()

    def _default_instructions(self) -> str:
        if self.text:
            return f"You act in {self.env_id}. Answer with your action as text."
        n = self.env.action_space.n
        named = f" ({', '.join(f'{i}={name}' for i, name in enumerate(self.names))})" if self.names else ""
        return f"You act in {self.env_id}. Answer with one action, 0-{n - 1}{named}."

    def _show(self, observation: Any) -> str:
        if self.env.render_mode == "ansi":
            frame = self.env.render()
            if isinstance(frame, str):  # colour marks the agent: keep it as [x], drop the escape codes
                return _ESCAPE.sub("", _HIGHLIGHT.sub(r"[\1]", frame)).strip("\n")
        return str(observation)

    def _action(self, text: str) -> Any:
        if self.text:
            return text
        words = re.findall(r"-?\d+|[a-z]+", text.lower())
        for word in reversed(words):
            if word.lstrip("-").isdigit() and 0 <= int(word) < self.env.action_space.n:
                return int(word)
            if word in self.names:
                return self.names.index(word)
        return None

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.turns = 0
        seed = task.get("seed")
        observation, _ = self.env.reset(seed=None if seed is None else int(seed))
        return [{"role": "system", "content": self.instructions},
                {"role": "user", "content": self._show(observation)}]

    def step(self, message: Message) -> StepResult:
        self.turns += 1
        out_of_turns = self.turns >= self.max_turns
        action = self._action(message.get("content") or "")
        if action is None:
            return StepResult([{"role": "user", "content": f"invalid action. {self.instructions}"}], 0.0,
                              out_of_turns, {"valid": False})
        observation, reward, terminated, truncated, _info = self.env.step(action)
        done = bool(terminated or truncated or out_of_turns)
        shown = [] if terminated else [{"role": "user", "content": self._show(observation)}]
        return StepResult(shown, float(reward), done,
                          {"valid": True, "terminated": bool(terminated), "truncated": bool(truncated)})

    def close(self) -> None:
        self.env.close()


def gym_tasks(n: int, seed: int = 0):
    """`n` task rows, each a distinct reset seed."""
    from datasets import Dataset

    seeds = list(range(seed, seed + n))
    return Dataset.from_dict({"prompt": [f"episode {s}" for s in seeds], "seed": seeds})
