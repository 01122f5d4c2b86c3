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


def judge_reward(rc: Any, i: int, output_dir: str) -> Any:
    """A `type: judge` reward (tokenmill.rewards.judge); a missing package, API key or bad prompt is a ConfigError."""
    import os

    api_key = None
    if rc.api_key_env:
        api_key = os.environ.get(rc.api_key_env)
        if not api_key:
            raise ConfigError(f"rewards.{i}.api_key_env: the environment variable {rc.api_key_env} is not set")
    cache_path = Path(output_dir, "judge_cache", f"{rc.name}.jsonl") if rc.cache == "disk" else None
    try:
        from tokenmill.rewards.judge import JudgeReward

        return JudgeReward(
            rc.url, rc.model, name=rc.name, weight=rc.weight, mode=rc.mode, rubric=rc.rubric, prompt=rc.prompt,
            system=rc.system, reference_column=rc.reference_column, both_orders=rc.both_orders,
            score_range=rc.score_range, score_pattern=rc.score_pattern, concurrency=rc.concurrency,
            timeout_s=rc.timeout_s, retries=rc.retries, backoff_s=rc.backoff_s, max_tokens=rc.max_tokens,
            temperature=rc.temperature, api_key=api_key, cache=rc.cache != "off", cache_path=cache_path,
            alarm_after=rc.alarm_after,
        )
    except ImportError as exc:
        raise ConfigError(f"rewards.{i}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"rewards.{i}.{exc}") from None


def builtin_function_reward(rc: Any) -> FunctionReward:
    """A `{builtin: ...}` reward (tokenmill.rewards.builtin) in a forked worker: math-verify's own timeouts are
    signal alarms, which work only in a process's main thread."""
    return FunctionReward(builtin_reward(rc), name=rc.name or rc.builtin, weight=rc.weight,
                          timeout_s=rc.batch_timeout_s, isolation="process")


def build_rewards(cfg: Any, extra: list[Callable[..., Any]] | None = None, task_reward=None,
                  model_reward: Callable[..., Any] | None = None) -> RewardSet:
    """The weighted set: `task_reward` (a row task's verifier) first, then `cfg.rewards`, then `extra`.
    `model_reward(rc, index, path)`: builds each `type: model` reward in place of a `ModelReward` in this process
    (on Ray, one that an actor of its own scores: `cluster.roles.reward_model`)."""
    rewards: list[Any] = []
    if task_reward is not None:
        rewards.append(FunctionReward(task_reward, name=cfg.data.task, weight=cfg.data.task_reward_weight))
    for i, rc in enumerate(cfg.rewards):
        if rc.type == "function":
            rewards.append(
                FunctionReward(
                    _reward_function(rc, i), name=rc.name, weight=rc.weight, timeout_s=rc.timeout_s,
                    per_sample=rc.per_sample, isolation=rc.isolation,
                )
            )
        elif rc.type == "judge":
            rewards.append(judge_reward(rc, i, cfg.tracking.output_dir))
        elif rc.type == "builtin":
            rewards.append(builtin_function_reward(rc))
        else:
            path = _reward_model_path(rc, i)
            rewards.append(model_reward(rc, i, path) if model_reward is not None else
                           ModelReward(path, name=rc.name, weight=rc.weight, batch_size=rc.batch_size))
    for fn in extra or []:
        rewards.append(fn if hasattr(fn, "weight") else FunctionReward(fn))
    if not rewards and cfg.env is None:
        raise ConfigError("rewards: give at least one reward (or an env, whose episodes' returns are the reward)")
    try:
        return RewardSet(rewards, max_steps=cfg.controller.steps)
    except ValueError as exc:
        raise ConfigError(f"rewards: {exc}") from None
