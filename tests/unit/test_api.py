"""`tokenmill.train`: wrong arguments are `ConfigError`s naming them (never a bare TypeError), found before any
model loads; the caller's config dict is never changed."""

from __future__ import annotations

import copy

import pytest

import tokenmill
from tokenmill.types import ConfigError, TokenmillError


def config() -> dict:
    return {"model": {"path": "org/model"}, "data": {"task": "addition"}, "generation": {"group_size": 2},
            "controller": {"steps": 1}}


@pytest.mark.parametrize("args, kwargs, message", [
    ((42,), {}, "config: expected a config (RLConfig), a dict of sections or a YAML path, not int"),
    (([1, 2],), {}, "config: expected a config (RLConfig), a dict of sections or a YAML path, not list"),
    ((None,), {}, "config: expected a config (RLConfig), a dict of sections or a YAML path, not NoneType"),
    ((config(),), {"rewards": [42]}, ("rewards[0]: expected a reward function fn(prompts, completions, "
                                      "**kwargs), not int")),
    ((config(),), {"rewards": 42}, "rewards: expected a list of reward functions, not int"),
    ((config(),), {"rewards": "pkg.mod:fn"}, "rewards: expected a list of reward functions, not str"),
    ((config(),), {"dataset": 7}, "dataset: expected a datasets.Dataset (rows with columns), not int"),
    ((config(),), {"generation__max_tokens": 0},
     "generation.max_tokens: Input should be greater than or equal to 1 (got 0)"),
    ((config(),), {"controller__steps": True}, "controller.steps: expected a whole number, not a boolean (got True)"),
])
def test_wrong_arguments_are_config_errors(args, kwargs, message):
    with pytest.raises(ConfigError) as err:
        tokenmill.train(*args, **kwargs)
    assert isinstance(err.value, TokenmillError)
    assert str(err.value) == message


def test_overrides_never_change_the_callers_dict():
    d = config()
    before = copy.deepcopy(d)
    with pytest.raises(ConfigError, match="generation.max_tokens"):
        tokenmill.train(d, generation__max_tokens=0)
    assert d == before
    with pytest.raises(ConfigError, match="training.learning_rate"):
        tokenmill.train(d, training__learning_rate=-1.0, algorithm__kl_coef=0.5)
    assert d == before
    # with an in-memory dataset the path placeholder goes into a copy too
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"prompt": ["1+1="]})
    d = {"model": {"path": "org/model"}, "data": {}, "generation": {"group_size": 2}}
    before = copy.deepcopy(d)

    def needs_answer(prompts, completions, answer, **kwargs):
        return [0.0 for _ in completions]

    with pytest.raises(ConfigError) as err:
        tokenmill.train(d, rewards=[needs_answer], dataset=rows)
    assert d == before
    assert str(err.value) == ("rewards[0] (passed to train): needs_answer() needs the dataset column(s) 'answer', "
                              "which the dataset lacks (columns: prompt); add them or give the parameter a default")


def test_a_reward_that_is_trl_shaped_passes_the_column_check():
    datasets = pytest.importorskip("datasets")
    from tokenmill.config import RLConfig, load_config
    from tokenmill.config.preflight import check_run

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    cfg = load_config(RLConfig, {"model": {"path": "org/model"}, "data": {"path": "<in-memory dataset>"}})
    rows = datasets.Dataset.from_dict({"prompt": ["a"]})
    notes = check_run(cfg, rewards=[reward_len], dataset=rows)
    assert notes == ["model.path 'org/model' is taken as a hub id (not looked up)"]
