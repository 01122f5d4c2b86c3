"""The environment protocol: what an agent acts in, gym-like and async-friendly.

An episode is `reset(task)` -> the first messages (system / user), then `step(assistant_message)` ->
`StepResult` until `done`. Messages are OpenAI-style dicts (`{"role": ..., "content": ...}`; an assistant
message may carry parsed `tool_calls`, and observations may be `tool` messages). Each of the three methods may
be a plain method or a coroutine: the agent loop awaits whatever it gets, and runs plain methods in a worker
thread so that a slow one cannot stall the other episodes.

Rewards: `StepResult.reward` is the reward of that turn; the episode's return is the sum over its turns.
An environment is made fresh for every episode (a factory, e.g. the class itself, is what the loop is given),
so instances need no reset-safety and can hold per-episode state in attributes.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

Message = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one assistant message.

    observation: messages appended to the conversation before the policy's next turn (usually one `user` or
                 `tool` message; may be empty when `done`)
    reward:      this turn's reward (summed over the episode)
    done:        the episode is over (success, failure or the environment's own turn limit)
    info:        anything JSON-serialisable, logged with the trajectory (e.g. {"solved": True})
    history:     None (the default): the observation is appended to the conversation. A message list: the
                 conversation so far is replaced by it, then the observation appended (a harness that strips
                 earlier turns, summarises or resets its context); trained step-wise (`env.stepwise`), since
                 one token sequence can no longer hold what the policy saw
    """

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    history: list[Message] | None = None


@runtime_checkable
class Environment(Protocol):
    """An episode's world. Methods may be sync or async (`async def`)."""

    def reset(self, task: dict[str, Any]) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, message: Message) -> StepResult | Awaitable[StepResult]: ...

    def close(self) -> None | Awaitable[None]: ...


EnvFactory = Callable[[], Environment]


async def call(fn: Callable[..., T | Awaitable[T]], *args: Any) -> T:
    """Await `fn(*args)`: a coroutine function directly, a plain function in a worker thread."""
    import asyncio

    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result


def as_step_result(value: Any) -> StepResult:
    """Accept a `StepResult` or a gym-style tuple `(observation, reward, done, info)`; an observation may be a
    string (sent as one user message) or a message list. Anything else is an error naming what came back."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) in (3, 4):
        obs, reward, done, *rest = value
        info = rest[0] if rest else {}
        if isinstance(obs, str):
            obs = [{"role": "user", "content": obs}]
        if not isinstance(obs, list) or not all(isinstance(m, dict) for m in obs):
            raise TypeError(f"step() observation must be a str or a list of message dicts, got {type(obs).__name__}")
        return StepResult(list(obs), float(reward), bool(done), dict(info or {}))
    raise TypeError(f"step() must return a StepResult or (observation, reward, done, info), got {type(value).__name__}")


def as_messages(value: Any) -> list[Message]:
    """reset()'s result: a message list, or a string (one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return list(value)
    raise TypeError(f"reset() must return a non-empty list of messages (or a string), got {value!r:.200}")
