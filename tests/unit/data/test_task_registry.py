"""The one task registry: `data.task` is validated against it, the Composer offers its names, and the run
builder takes rows from it for row tasks and env tasks alike."""

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.data.registry import HELD_OUT_SEED_OFFSET, ROW_TASKS, task_names, task_splits
from tokenmill.data.tasks import addition_dataset
from tokenmill.envs import BUILTIN_ENVS, env_tasks
from tokenmill.types import ConfigError


def test_names_are_the_row_tasks_then_the_builtin_environments():
    assert task_names() == ("addition", "countdown", "shapes", "guess_number", "coding", "calculator", "gym")
    assert task_names() == (*ROW_TASKS, *BUILTIN_ENVS)


def test_config_accepts_every_registered_name_and_names_them_all_when_rejecting():
    for name in task_names():
        assert load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": name}}).data.task == name
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "sorting"}})
    assert "data.task must be one of addition, countdown, shapes, guess_number, coding, calculator, gym; got " \
        "'sorting'" in (
        str(err.value)
    )


def test_row_task_held_out_rows_come_from_the_offset_seed_and_are_excluded_from_train():
    train, held, reward = task_splits("addition", 40, 10, seed=3)
    assert held["prompt"] == addition_dataset(10, seed=3 + HELD_OUT_SEED_OFFSET)["prompt"]
    assert HELD_OUT_SEED_OFFSET == 10_000
    assert not set(train["prompt"]) & set(held["prompt"])
    assert reward is ROW_TASKS["addition"][1]


def test_env_task_rows_come_from_the_environment_generator_and_have_no_verifier():
    train, held, reward = task_splits("calculator", 12, 5, seed=2)
    assert reward is None
    assert train[:] == env_tasks("calculator", 12, seed=2)[:]
    assert held[:] == env_tasks("calculator", 5, seed=2 + HELD_OUT_SEED_OFFSET)[:]
    assert task_splits("calculator", 3, 0)[1] is None


def test_unknown_task_in_python_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"data.task: 'sorting' is not a built-in task \(built-in: addition,"):
        task_splits("sorting", 1, 0)


def test_composer_offers_exactly_the_registered_tasks():
    from tokenmill.composer.schema_ui import schema_fields

    [field] = [f for f in schema_fields("rl") if f["path"] == "data.task"]
    assert field["enum"] == [*task_names(), None]
