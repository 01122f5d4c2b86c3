"""A run's rows from its `data:` section: a built-in task's splits (with its verifier), or a dataset's rows
with held-out rows split off or read from `data.eval_path`."""

from __future__ import annotations

from typing import Any

from tokenmill.data.formats import rl_prompt_problem
from tokenmill.data.prompts import load_rows, split_held_out
from tokenmill.types import ConfigError


def build_datasets(cfg: Any, dataset=None):
    """(train rows, eval rows or None, the task's reward function or None). Held-out rows: a task's own, or
    `data.num_eval` rows split off the dataset (a passed-in one only when num_eval is set), or `data.eval_path`."""
    from tokenmill.data.registry import task_splits

    data = cfg.data
    if dataset is None and cfg.env is not None and cfg.env.verifiers is not None:  # the taskset's tasks
        from tokenmill.envs.verifiers_env import load_cached

        rows, held = split_held_out(load_cached(cfg.env.verifiers, cfg.env.kwargs).rows, data.num_eval or 0,
                                    seed=cfg.training.seed)
        return rows, held, None
    if dataset is None and data.task is not None:  # a row task brings its verifier; an env task's episodes are the reward
        return task_splits(data.task, data.num_train, data.held_out_rows, seed=cfg.training.seed, **data.task_kwargs)
    if dataset is None:
        dataset = _with_prompts(load_rows(data.path, data.split), data.prompt_column, "data.path")
    rows, held = split_held_out(dataset, data.num_eval or 0, seed=cfg.training.seed)
    if data.eval_path is not None:
        held = _with_prompts(load_rows(data.eval_path, data.split, "data.eval_path"), data.prompt_column,
                             "data.eval_path")
    return rows, held, None


def _with_prompts(rows, column: str, field: str):
    problem = rl_prompt_problem(rows.column_names, column)
    if problem:
        raise ConfigError(problem if field == "data.path" else f"{field}: {problem}")
    return rows
