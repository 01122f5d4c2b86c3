"""The `Environment` contract (envs/base.py), run against every built-in environment and a remote one.

`reset(task)` gives the first messages (a non-empty list of role/content dicts); `step(message)` answers any
assistant message, malformed ones included, with a `StepResult` (messages, a finite reward, done, a JSON-able
info) and never raises; an episode of nonsense ends within the environment's own limit; a fresh instance on
the same task replays the same episode; `close()` ends it. Methods may be plain or async.

Every entry of `tokenmill.envs.BUILTIN_ENVS` is checked (a new built-in needs no edit here); another
implementation (a remote environment, an OpenEnv one) is one entry in `OTHERS`.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tokenmill.envs import BUILTIN_ENVS, env_tasks, resolve_env
from tokenmill.envs.base import Environment, as_messages, as_step_result, call

NONSENSE = {"role": "assistant", "content": "zzz <tool_call>{not json</tool_call> ```python\nwhile True\n```"}
MAX_STEPS = 60  # every environment ends an episode of nonsense well before this
KWARGS = {"gym": {"env_id": "FrozenLake-v1"}}  # env.kwargs a built-in cannot do without


@contextmanager
def builtin(name: str) -> Iterator[tuple[Callable[[], Environment], list[dict]]]:
    yield resolve_env(name, KWARGS.get(name)), env_tasks(name, 2, seed=0)


@contextmanager
def remote() -> Iterator[tuple[Callable[[], Environment], list[dict]]]:
    """guess_number served by `create_app` on a loopback port, played through `RemoteEnvironment`."""
    from tokenmill.envs.remote import RemoteEnvironment
    from tokenmill.envs.server import create_app
    from tokenmill.serving import start_in_thread

    server, _ = start_in_thread(create_app(resolve_env("guess_number")))
    try:
        yield (lambda: RemoteEnvironment(server.url)), env_tasks("guess_number", 2, seed=0)
    finally:
        server.stop()


@contextmanager
def openenv() -> Iterator[tuple[Callable[[], Environment], list[dict]]]:
    """The example OpenEnv game (examples/openenv_guess) served with OpenEnv's app factory on a loopback port,
    played through `OpenEnvEnvironment` and OpenEnv's client."""
    from pathlib import Path

    from tokenmill.config.openenv import OpenEnvConfig
    from tokenmill.envs.openenv import openenv_factory

    game = Path(__file__).parents[2] / "examples" / "openenv_guess" / "env.py"
    factory = openenv_factory(OpenEnvConfig(serve=f"{game}:GuessEnvironment", observation="message"), max_concurrent=4)
    try:
        yield factory, [{"prompt": "Guess my number.", "seed": seed} for seed in (0, 1)]
    finally:
        factory.close()


OTHERS: dict[str, Callable[[], object]] = {"remote": remote, "openenv": openenv}
ENVS = {**{name: (lambda name=name: builtin(name)) for name in BUILTIN_ENVS}, **OTHERS}


@pytest.fixture(params=sorted(ENVS))
def env_and_tasks(request):
    with ENVS[request.param]() as made:
        yield made


async def episode(factory: Callable[[], Environment], task: dict) -> list:
    """Reset, then nonsense until done; the transcript of what the environment said."""
    env = factory()
    assert isinstance(env, Environment)
    first = as_messages(await call(env.reset, task))
    assert first and all(isinstance(m.get("content", ""), str) and m["role"] for m in first)
    transcript: list = [first]
    try:
        for _ in range(MAX_STEPS):
            result = as_step_result(await call(env.step, NONSENSE))
            assert isinstance(result.observation, list)
            assert all(isinstance(m, dict) and m.get("role") for m in result.observation)
            assert isinstance(result.reward, float) and math.isfinite(result.reward)
            json.dumps(result.info)  # logged with the trajectory
            transcript.append((result.observation, result.reward, result.done, result.info))
            if result.done:
                return transcript
        raise AssertionError(f"no end after {MAX_STEPS} nonsense turns")
    finally:
        await call(env.close)


def test_an_episode_of_nonsense_is_answered_and_ends(env_and_tasks):
    factory, tasks = env_and_tasks
    transcript = asyncio.run(episode(factory, tasks[0]))
    assert len(transcript) >= 2 and transcript[-1][2] is True


def test_a_fresh_instance_replays_the_same_episode(env_and_tasks):
    factory, tasks = env_and_tasks

    async def twice():
        return await asyncio.gather(episode(factory, tasks[1]), episode(factory, tasks[1]))

    first, second = asyncio.run(twice())
    assert first == second
