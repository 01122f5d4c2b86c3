"""The one registry of built-in tasks: what `data.task` may name, and how its rows are made.

Two kinds share the registry. A *row task* (`addition`, `countdown`) generates prompts and brings its own
verifier. An *env task* is a built-in environment's task generator (`guess_number`, `calculator`, `coding`,
`gym`, read from `tokenmill.envs.BUILTIN_ENVS`); its episodes' returns are the reward, so it has no verifier.
A third family is named by a prefix: `reasoning_gym:<name>` (and `reasoning_gym:mix`) are reasoning-gym's
generators, row tasks scored by the generator's own `score_answer` (`tokenmill.data.reasoning_gym`).
The config validates `data.task` with `task_problem` (the names in `task_names()`, or a prefixed one), the
Composer offers the fixed names, and the run builder asks `task_splits` for the rows.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from tokenmill.data import reasoning_gym as gym
from tokenmill.data.shapes import shapes_dataset, shapes_reward
from tokenmill.data.tasks import addition_dataset, addition_reward, countdown_dataset, countdown_reward
from tokenmill.envs import BUILTIN_ENVS, env_tasks
from tokenmill.types import ConfigError

# Held-out rows are drawn from their own stream (seed + offset), so evaluation prompts are the same for every
# run with the same seed and independent of how many training rows were drawn.
HELD_OUT_SEED_OFFSET = 10_000

# row task name -> (row generator `make(n, seed=, exclude=, **kwargs)`, batched reward function)
ROW_TASKS: dict[str, tuple[Callable[..., Any], Callable[..., list[float]]]] = {
    "addition": (addition_dataset, addition_reward),
    "countdown": (countdown_dataset, countdown_reward),
    "shapes": (shapes_dataset, shapes_reward),  # needs a vision-language model (data.shapes)
}


def task_names() -> tuple[str, ...]:
    """Every name `data.task` accepts: the row tasks, then the built-in environments' tasks."""
    return (*ROW_TASKS, *BUILTIN_ENVS)


def task_problem(task: str, kwargs: dict[str, Any]) -> str | None:
    """Why `data.task` (with `data.task_kwargs`) is not a task, naming the field and the closest names; None
    when it is one. A `reasoning_gym:` task is checked against the package's generators and settings."""
    if gym.is_gym_task(task):
        try:
            gym.parse_spec(task, kwargs)
        except ConfigError as exc:
            return str(exc)
        return None
    if task in task_names():
        return None
    close = difflib.get_close_matches(task, task_names(), n=3, cutoff=0.6) or gym.close_names(task)
    hint = f"; did you mean {' or '.join(close)}?" if close else f" (or {gym.PREFIX}<name>, a reasoning-gym task)"
    return f"data.task must be one of {', '.join(task_names())}; got {task!r}{hint}"


def is_env_task(name: str) -> bool:
    return name in BUILTIN_ENVS


def task_splits(task: str, num_train: int, num_eval: int, seed: int = 0, **kwargs: Any):
    """(train rows, held-out rows or None, the task's reward function or None for an env task).

    A row task's held-out prompts never appear in its training rows; an env task draws both from its own
    generator (held-out from `seed + HELD_OUT_SEED_OFFSET`)."""
    held_seed = seed + HELD_OUT_SEED_OFFSET
    if is_env_task(task):
        held = env_tasks(task, num_eval, seed=held_seed, **kwargs) if num_eval else None
        return env_tasks(task, num_train, seed=seed, **kwargs), held, None
    if gym.is_gym_task(task):
        return gym.splits(task, num_train, num_eval, seed=seed, **kwargs)
    if task not in ROW_TASKS:
        raise ConfigError(f"data.task: {task!r} is not a built-in task (built-in: {', '.join(task_names())})")
    make, reward = ROW_TASKS[task]
    held = make(num_eval, seed=held_seed, **kwargs) if num_eval else None
    # rows whose prompt text repeats (a picture task) name themselves by a `key` column
    exclude = set(held["key" if "key" in held.column_names else "prompt"]) if held is not None else None
    return make(num_train, seed=seed, exclude=exclude, **kwargs), held, reward
