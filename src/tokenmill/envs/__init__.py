"""Environments: the protocol (`base`), built-in environments with task generators, remote environments.

`resolve_env(name, kwargs)` turns a config's `env.name` (a built-in name, `module:Class` or `file.py:Class`)
into a factory; `env_tasks(name, n, seed)` gives a built-in environment's task rows.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenmill.config.imports import resolve
from tokenmill.envs.base import EnvFactory, Environment, Message, StepResult
from tokenmill.types import ConfigError

# built-in name -> (environment class, task generator), as import strings (imported only when used)
BUILTIN_ENVS: dict[str, tuple[str, str]] = {
    "guess_number": ("tokenmill.envs.guess:GuessNumberEnv", "tokenmill.envs.guess:guess_number_tasks"),
    "coding": ("tokenmill.envs.coding:CodingEnv", "tokenmill.envs.coding:coding_tasks"),
    "calculator": ("tokenmill.envs.calculator:CalculatorEnv", "tokenmill.envs.calculator:calculator_tasks"),
    "gym": ("tokenmill.envs.gym:GymTextEnv", "tokenmill.envs.gym:gym_tasks"),
}


def resolve_env(name: str, kwargs: dict[str, Any] | None = None, field: str = "env.name") -> EnvFactory:
    """A factory making a fresh environment per episode from a built-in name, 'module:Class' or
    'path/to/file.py:Class' (with kwargs, `partial(Class, **kwargs)`)."""
    spec = BUILTIN_ENVS[name][0] if name in BUILTIN_ENVS else name
    cls = resolve(spec, field)
    if not callable(cls):
        raise ConfigError(f"{field}: {spec!r} names a {type(cls).__name__}, not a class or factory")
    return functools.partial(cls, **kwargs) if kwargs else cls


def env_tasks(name: str, n: int, seed: int = 0, **kwargs: Any):
    """Task rows of a built-in environment."""
    if name not in BUILTIN_ENVS:
        raise ConfigError(f"data.task: {name!r} has no built-in tasks (built-in: {', '.join(BUILTIN_ENVS)})")
    return resolve(BUILTIN_ENVS[name][1], "data.task")(n, seed=seed, **kwargs)


__all__ = ["BUILTIN_ENVS", "EnvFactory", "Environment", "Message", "StepResult", "env_tasks", "resolve_env"]
