"""The short Python API.

    import tokenmill

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    result = tokenmill.train(
        {"model": {"path": "my-model"}, "data": {"path": "train.jsonl"}, "controller": {"steps": 200}},
        rewards=[correct],
    )
    print(result["last_metrics"]["reward/mean"])

`sft`, `preference` and `reward_model` run the offline modes the same way, from an `SFTConfig` /
`PreferenceConfig`, a dict or a YAML path:

    tokenmill.sft({"model": {"path": "my-model"}, "data": {"path": "chats.jsonl"}, "messages_column": "messages"})
    tokenmill.preference({"model": {"path": "my-model"}, "data": {"path": "pairs.jsonl"}, "objective": "dpo"})
    tokenmill.reward_model({"model": {"path": "my-model"}, "data": {"path": "pairs.jsonl"}, "output_dir": "rm"})
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.config.load import load_config, read_yaml_tree
from tokenmill.config.offline import OfflineConfig, PreferenceConfig, SFTConfig
from tokenmill.config.preflight import check_run
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import build_run
from tokenmill.controller.offline import run_preference_config, run_sft_config
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


def _as_tree(config: Any, schema: type) -> dict[str, Any] | str | Path:
    """A `schema` instance as its dict of sections; a dict or a YAML path as given; anything else refused."""
    if isinstance(config, schema):
        config = config.model_dump()
    if not isinstance(config, (dict, str, Path)):
        raise ConfigError(f"config: expected a config ({schema.__name__}), a dict of sections or a YAML path, "
                          f"not {type(config).__name__}")
    return config


def _config_tree(config: Any, dataset: Any) -> dict[str, Any] | str | Path:
    """The config as load_config takes it; the caller's dict is copied, never changed."""
    config = _as_tree(config, RLConfig)
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


def _offline_config(schema: type[OfflineConfig], config: Any, overrides: dict[str, Any], mode: str | None = None):
    """`config` (a `schema` instance, a dict or a YAML path) with `a__b=` overrides, validated; with `mode`,
    that mode's fixed values applied (reward_model's objective)."""
    config = _as_tree(config, schema)
    if mode is not None:
        config = {**(config if isinstance(config, dict) else read_yaml_tree(config)), "mode": mode}
    return load_config(schema, config, {k.replace("__", "."): v for k, v in overrides.items()})


def sft(config: SFTConfig | dict[str, Any] | str | Path, **overrides: Any) -> dict[str, Any]:
    """Supervised fine-tuning: train the model `config` names and write it to `output_dir`. `config` is an
    SFTConfig, a dict or a YAML path; `overrides` as `train`'s (`learning_rate=1e-4`, `data__split="dev"`).
    Returns {"losses": the token NLL of each step, "output_dir": ...}."""
    return run_sft_config(_offline_config(SFTConfig, config, overrides))


def preference(config: PreferenceConfig | dict[str, Any] | str | Path, **overrides: Any) -> dict[str, Any]:
    """Offline preference training (`objective` dpo, ipo or simpo; or reward_model) on prompt / chosen /
    rejected pairs; the trained model goes to `output_dir`. Returns {"objective", "losses" (each step's),
    "output_dir"} and, for a built-in task, its held-out numbers ("heldout_margin",
    "heldout_chosen_preferred")."""
    return run_preference_config(_offline_config(PreferenceConfig, config, overrides))


def reward_model(config: PreferenceConfig | dict[str, Any] | str | Path, **overrides: Any) -> dict[str, Any]:
    """A Bradley-Terry reward model trained on pairs: `preference` with `objective: reward_model` (another
    objective in `config` is a `ConfigError`). Its `output_dir` loads as an RL config's `rewards: [{path:
    ...}]`. Returns as `preference` does, with "heldout_pairwise_accuracy" for a built-in task."""
    return run_preference_config(_offline_config(PreferenceConfig, config, overrides, mode="reward_model"))
