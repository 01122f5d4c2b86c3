"""A run's `RewardSet` from its config: the task's own verifier, the `rewards:` functions and reward models,
and rewards passed in from Python. Everything is checked before any policy is loaded (ConfigError naming the
field)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.rewards.base import FunctionReward
from tokenmill.rewards.builtin import builtin_reward
from tokenmill.rewards.model import ModelReward
from tokenmill.rewards.set import RewardSet
from tokenmill.types import ConfigError


def _reward_function(rc: Any, i: int) -> Callable[..., Any]:
    from tokenmill.config.imports import resolve

    fn = resolve(rc.function, f"rewards.{i}.function")
    if not callable(fn):
        raise ConfigError(f"rewards.{i}.function: {rc.function!r} is not callable")
    return fn


def _reward_model_path(rc: Any, i: int) -> str:
    if not Path(rc.path).exists():
        raise ConfigError(f"rewards.{i}.path: no reward model folder at {rc.path!r}")
    return rc.path


def _kind(rc: Any) -> str:
    """'function', 'model' or 'builtin': which of RewardConfig's union members `rc` is."""
    return rc.type


def build_rewards(cfg: Any, extra: list[Callable[..., Any]] | None = None, task_reward=None) -> RewardSet:
    """The weighted set: `task_reward` (a row task's verifier) first, then `cfg.rewards`, then `extra`."""
    rewards: list[Any] = []
    if task_reward is not None:
        rewards.append(FunctionReward(task_reward, name=cfg.data.task, weight=cfg.data.task_reward_weight))
    for i, rc in enumerate(cfg.rewards):
        if _kind(rc) == "function":
            rewards.append(
                FunctionReward(
                    _reward_function(rc, i), name=rc.name, weight=rc.weight, timeout_s=rc.timeout_s,
                    per_sample=rc.per_sample, isolation=rc.isolation,
                )
            )
        elif _kind(rc) == "builtin":  # math-verify's own timeouts are signal alarms: a forked worker's main thread
            rewards.append(FunctionReward(builtin_reward(rc), name=rc.name or rc.builtin, weight=rc.weight,
                                          timeout_s=rc.batch_timeout_s, isolation="process"))
        else:
            path = _reward_model_path(rc, i)
            rewards.append(ModelReward(path, name=rc.name, weight=rc.weight, batch_size=rc.batch_size))
    for fn in extra or []:
        rewards.append(fn if hasattr(fn, "weight") else FunctionReward(fn))
    if not rewards and cfg.env is None:
        raise ConfigError("rewards: give at least one reward (or an env, whose episodes' returns are the reward)")
    try:
        return RewardSet(rewards, max_steps=cfg.controller.steps)
    except ValueError as exc:
        raise ConfigError(f"rewards: {exc}") from None
