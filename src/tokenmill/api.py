"""The short Python API.

    import tokenmill

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    result = tokenmill.train(
        {"model": {"path": "my-model"}, "data": {"path": "train.jsonl"}, "controller": {"steps": 200}},
        rewards=[correct],
    )
    print(result["last_metrics"]["reward/mean"])
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.config.load import load_config
from tokenmill.config.preflight import check_run
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import build_run
from tokenmill.controller.rl import run_rl
from tokenmill.types import ConfigError


def _checked_rewards(rewards: Any) -> list[Callable[..., Any]] | None:
    if rewards is None:
        return None
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, (list, tuple)):
        raise ConfigError(f"rewards: expected a list of reward functions, not {type(rewards).__name__}")
    for i, fn in enumerate(rewards):
        if not callable(fn):
            raise ConfigError(f"rewards[{i}]: expected a reward function fn(prompts, completions, **kwargs), "
                              f"not {type(fn).__name__}")
    return list(rewards)


def _config_tree(config: Any, dataset: Any) -> RLConfig | dict[str, Any] | str | Path:
    """The config as load_config takes it; the caller's dict is copied, never changed."""
    if isinstance(config, RLConfig):
        config = config.model_dump()
    if not isinstance(config, (dict, str, Path)):
        raise ConfigError(f"config: expected an RLConfig, a dict of sections or a YAML path, not "
                          f"{type(config).__name__}")
    if dataset is not None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(f"dataset: expected a datasets.Dataset (rows with columns), not "
                              f"{type(dataset).__name__}")
        if isinstance(config, dict):
            config = copy.deepcopy(config)
            data = config.setdefault("data", {})
            if isinstance(data, dict):
                data.setdefault("path", "<in-memory dataset>")
    return config


def train(
    config: RLConfig | dict[str, Any] | str | Path,
    rewards: list[Callable[..., Any]] | None = None,
    dataset=None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run GRPO-family RL. `config` is an RLConfig, a dict or a YAML path; `overrides` use dotted keys
    with `__` for dots (`algorithm__kl_coef=0.01`). Python reward functions and a `datasets.Dataset`
    may be passed directly. Whatever is wrong with the arguments is a `ConfigError` naming it (before any
    model loads); the caller's dict is never changed."""
    dotted = {k.replace("__", "."): v for k, v in overrides.items()}
    rewards = _checked_rewards(rewards)
    cfg = load_config(RLConfig, _config_tree(config, dataset), dotted)
    check_run(cfg, rewards=rewards, dataset=dataset)
    run = build_run(cfg, rewards=rewards, dataset=dataset)
    try:
        return run_rl(run)
    finally:
        run.close()
