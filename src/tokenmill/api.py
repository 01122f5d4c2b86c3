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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.config.load import load_config
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import build_run
from tokenmill.controller.rl import run_rl


def train(
    config: RLConfig | dict[str, Any] | str | Path,
    rewards: list[Callable[..., Any]] | None = None,
    dataset=None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run GRPO-family RL. `config` is an RLConfig, a dict or a YAML path; `overrides` use dotted keys
    with `__` for dots (`algorithm__kl_coef=0.01`). Python reward functions and a `datasets.Dataset`
    may be passed directly."""
    dotted = {k.replace("__", "."): v for k, v in overrides.items()}
    if isinstance(config, RLConfig):
        config = config.model_dump()
    if dataset is not None and isinstance(config, dict):
        config.setdefault("data", {}).setdefault("path", "<in-memory dataset>")
    cfg = load_config(RLConfig, config, dotted) if not isinstance(config, RLConfig) else config
    run = build_run(cfg, rewards=rewards, dataset=dataset)
    try:
        return run_rl(run)
    finally:
        run.close()
