"""Config loading: readable errors naming the dotted field, cross-field checks, overrides, the CLI."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.cli import main
from tokenmill.config import AlgorithmConfig, RLConfig, load_config, parse_overrides
from tokenmill.types import ConfigError


def base() -> dict:
    return {"model": {"path": "some/model"}, "data": {"task": "addition"}}


@pytest.fixture
def good_yaml(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump({**base(), "generation": {"group_size": 4}, "controller": {"steps": 3}}))
    return str(path)


def test_defaults_and_overrides_from_dict_and_yaml(good_yaml):
    cfg = load_config(RLConfig, base())
    assert cfg.algorithm.clip_low == 0.2 and cfg.generation.group_size == 8 and cfg.rewards == []
    cfg = load_config(RLConfig, good_yaml, {"algorithm.kl_coef": 0.01, "generation.stop": ["\n"]})
    assert cfg.generation.group_size == 4 and cfg.controller.steps == 3
    assert cfg.algorithm.kl_coef == 0.01 and cfg.generation.stop == ["\n"]
    # an override may also create a section that the file did not have
    cfg = load_config(RLConfig, good_yaml, {"checkpoint.every": 5})
    assert cfg.checkpoint.every == 5


def test_parse_overrides_types_follow_yaml():
    out = parse_overrides(["--algorithm.kl_coef", "0.01", "--tracking.wandb=true", "--generation.stop", "[a, b]",
                           "--model.path", "x/y", "--training.seed", "7", "--data.task", "{not yaml"])
    assert out == {
        "algorithm.kl_coef": 0.01, "tracking.wandb": True, "generation.stop": ["a", "b"],
        "model.path": "x/y", "training.seed": 7, "data.task": "{not yaml",
    }
    assert type(out["training.seed"]) is int


@pytest.mark.parametrize("args, needle", [
    (["algorithm.clip_low", "5"], "--section.field"),
    (["--algorithm.clip_low"], "no value"),
    (["--"], "--section.field"),
])
def test_parse_overrides_rejects_malformed(args, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_overrides(args)


@pytest.mark.parametrize("overrides, field, detail", [
    ({"algorithm.clip_low": 5}, "algorithm.clip_low", "less than or equal to 1"),
    ({"algorithm.clip_low": -0.1}, "algorithm.clip_low", "greater than or equal to 0"),
    ({"algorithm.loss_agg": "mean"}, "algorithm.loss_agg", "token_mean"),
    ({"algorithm.kl_estimator": "k2"}, "algorithm.kl_estimator", "k3"),
    ({"algorithm.loss": "dpo"}, "algorithm.loss", "cispo"),
    ({"algorithm.max_sampling_rounds": 0}, "algorithm.max_sampling_rounds", "greater than or equal to 1"),
    ({"generation.temperature": 0}, "generation.temperature", "greater than 0"),
    ({"generation.temperature": "hot"}, "generation.temperature", "valid number"),
    ({"generation.top_p": 1.5}, "generation.top_p", "less than or equal to 1"),
    ({"generation.max_tokens": 0}, "generation.max_tokens", "greater than or equal to 1"),
    ({"generation.stop": "abc"}, "generation.stop", "valid list"),
    ({"training.learning_rate": 0}, "training.learning_rate", "greater than 0"),
    ({"training.micro_batch_tokens": 8}, "training.micro_batch_tokens", "16"),
    ({"training.lr": 1e-5}, "training.lr", "unknown field; did you mean learning_rate?"),
    ({"model.path": ""}, "model.path", "at least 1 character"),
    ({"checkpoint.keep_last": 0}, "checkpoint.keep_last", "greater than or equal to 1"),
])
def test_bad_values_name_the_dotted_field(overrides, field, detail):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), overrides)
    message = str(err.value)
    assert message.startswith(f"{field}: ")
    assert detail in message
    assert "\n" not in message  # one problem, one line


def test_several_bad_fields_are_all_reported():
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), {"algorithm.clip_low": 5, "generation.temperature": -1, "training.x": 1})
    lines = str(err.value).splitlines()
    assert sorted(line.split(":")[0] for line in lines) == [
        "algorithm.clip_low", "generation.temperature", "training.x",
    ]


def test_unknown_section_and_non_section():
    with pytest.raises(ConfigError, match=r"^trainer: unknown section; did you mean training or tracking\?$"):
        load_config(RLConfig, {**base(), "trainer": {"lr": 1}})
    with pytest.raises(ConfigError, match=r"model\.path\.x: path is not a section"):
        load_config(RLConfig, base(), {"model.path.x": 1})
    with pytest.raises(ConfigError, match=r"^model: Field required"):
        load_config(RLConfig, {"data": {"task": "addition"}})


def test_reward_entries_are_checked(tmp_path):
    good = {**base(), "rewards": [{"function": "m:f", "weight": 0.5}, {"type": "model", "path": "rm"}]}
    cfg = load_config(RLConfig, good)
    assert [r.type for r in cfg.rewards] == ["function", "model"] and cfg.rewards[0].weight == 0.5
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {**base(), "rewards": [{"function": "m:f", "weight": "heavy"}]})
    assert "rewards.0" in str(err.value) and "weight" in str(err.value)
    # a list is set whole from the command line; a dotted path into it is refused with a hint
    with pytest.raises(ConfigError, match=r"rewards\.0\.weight: list fields are set whole"):
        load_config(RLConfig, good, {"rewards.0.weight": 2.0})


def test_union_members_are_not_shown_as_fields():
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), {"model.lora.target_modules": 5})
    assert str(err.value).splitlines() == [
        "model.lora.target_modules: Input should be a valid list (got 5)",
        "model.lora.target_modules: Input should be 'all-linear' (got 5)",
    ]


def test_reward_error_names_rewards_0_weight():
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {**base(), "rewards": [{"function": "m:f", "weight": "heavy"}]})
    message = str(err.value)
    assert message.startswith("rewards.0.weight: ")
    assert "RewardModelConfig" not in message and "RewardFunctionConfig" not in message


@pytest.mark.parametrize("overrides", [
    {"rewards": [{"function": "m:f", "weight": math.nan}]},
    {"algorithm.kl_coef": math.inf},
    {"training.betas": [0.9, 2.0]},
])
def test_non_finite_values_rejected(overrides):
    with pytest.raises(ConfigError):
        load_config(RLConfig, base(), overrides)


@pytest.mark.parametrize("data, needle", [
    ({"task": "addition", "path": "rows.jsonl"}, "exactly one of data.task or data.path"),
    ({}, "exactly one of data.task or data.path"),
    ({"task": "sorting"}, "data.task must be one of addition, countdown, shapes, guess_number"),
])
def test_data_needs_exactly_one_source(data, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(RLConfig, {"model": {"path": "m"}, "data": data})
    assert str(err.value).startswith("data: ")
    assert load_config(RLConfig, {"model": {"path": "m"}, "data": {"path": "rows.jsonl"}}).data.task is None


def test_mini_batches_cannot_exceed_sequences():
    ok = load_config(RLConfig, base(), {"controller.prompts_per_step": 2, "generation.group_size": 4,
                                        "algorithm.mini_batches": 8})
    assert ok.algorithm.mini_batches == 8
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), {"controller.prompts_per_step": 2, "generation.group_size": 4,
                                       "algorithm.mini_batches": 9})
    assert str(err.value).startswith("algorithm.mini_batches: algorithm.mini_batches (9) exceeds the sequences per step (8")


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_group_baselines_need_a_group(advantage):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), {"algorithm.advantage": advantage, "generation.group_size": 1})
    assert str(err.value).startswith(f"generation.group_size: algorithm.advantage {advantage!r} compares each "
                                      "completion with the others of its prompt, so a group of 1 makes every "
                                      "advantage 0")
    assert "set generation.group_size >= 2" in str(err.value)
    # PPO's critic is its baseline: one completion per prompt is its usual setting
    ok = load_config(RLConfig, base(), {"algorithm.advantage": "gae", "generation.group_size": 1})
    assert ok.generation.group_size == 1


def test_yaml_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(RLConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RLConfig, bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(RLConfig, bad)


def test_assignment_is_validated_too():
    algo = AlgorithmConfig()
    with pytest.raises(ValueError):
        algo.clip_low = 3.0
    assert algo.clip_low == 0.2


# --------------------------------------------------------------------------------------------- fuzzing

FIELDS = [
    "algorithm.clip_low", "algorithm.clip_high", "algorithm.kl_coef", "algorithm.advantage", "algorithm.loss_agg",
    "algorithm.mini_batches", "algorithm.ppo_epochs", "generation.temperature", "generation.top_p",
    "generation.top_k", "generation.group_size", "generation.max_tokens", "generation.stop",
    "training.learning_rate", "training.betas", "training.micro_batch_tokens", "training.lr_schedule",
    "controller.steps", "controller.prompts_per_step", "data.task", "data.path", "data.num_eval", "model.path",
    "rewards", "tracking.console", "checkpoint.keep_last", "algorithm", "generation.temperature.x",
    "nonsense", "model.path.deeper", "",
]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["grpo", "rloo", "token_mean", "addition", "countdown", "plain", "k3"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _check(overrides):
    try:
        cfg = load_config(RLConfig, base(), overrides)
    except ConfigError as exc:
        assert str(exc)  # always says something
        return
    assert isinstance(cfg, RLConfig)
    # a valid result round-trips through its own dump
    assert RLConfig.model_validate(cfg.model_dump()) == cfg
    seqs = cfg.sequences_per_step
    assert cfg.algorithm.mini_batches <= seqs
    assert 0 <= cfg.algorithm.clip_low <= 1 and cfg.generation.temperature > 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_fuzzed_override_values_give_a_config_or_a_config_error(overrides):
    _check(overrides)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(FIELDS), st.text(max_size=16)), max_size=4))
def test_fuzzed_command_line_strings_give_a_config_or_a_config_error(pairs):
    args = [a for key, raw in pairs for a in (f"--{key}", raw)]
    try:
        overrides = parse_overrides(args)
    except ConfigError:
        return
    _check(overrides)


# ------------------------------------------------------------------------------------------------- CLI

def test_cli_validate_good_file(good_yaml, capsys):
    assert main(["validate", good_yaml]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "3 steps of 8 prompts x 4 samples = 32 sequences" in out


def test_cli_validate_bad_override_exits_2_without_traceback(good_yaml, capsys):
    assert main(["validate", good_yaml, "--algorithm.clip_low", "5"]) == 2
    captured = capsys.readouterr()
    assert "algorithm.clip_low" in captured.err
    assert "less than or equal to 1 (got 5)" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == ""


def test_cli_validate_override_applies(good_yaml, capsys):
    assert main(["validate", good_yaml, "--generation.group_size=2", "--controller.steps", "9"]) == 0
    assert "9 steps of 8 prompts x 2 samples = 16 sequences" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["validate", "missing-file.yaml"], "config file not found"),
    (["validate", "GOOD", "algorithm.clip_low", "5"], "expected an override like --section.field"),
    (["validate", "GOOD", "--algorithm.clip_low"], "has no value"),
    (["validate", "GOOD", "--training.lr", "1"], "training.lr: unknown field; did you mean learning_rate?"),
])
def test_cli_config_errors(argv, needle, good_yaml, capsys):
    argv = [good_yaml if a == "GOOD" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_overrides_without_a_file(capsys):
    assert main(["validate", "--model.path", "m", "--data.task", "addition"]) == 0
    assert "valid" in capsys.readouterr().out


@pytest.mark.parametrize("reward, needle", [
    ({"function": "tokenmill.data.tasks:no_such_reward"}, "rewards.0.function: module 'tokenmill.data.tasks' has no attribute"),
    ({"function": "no_such_package.rewards:f"}, "rewards.0.function: cannot import module 'no_such_package.rewards'"),
    ({"function": "tokenmill.data.registry:ROW_TASKS"},
     "rewards.0.function: 'tokenmill.data.registry:ROW_TASKS' is not callable"),
    ({"path": "/nonexistent/reward-model"}, "rewards.0.path: no reward model folder"),
])
def test_cli_validate_resolves_reward_references(tmp_path, reward, needle, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"task": "addition"}, "rewards": [reward]}))
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cross_field_checks_name_both_fields():
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, base(), {"algorithm.overlong_buffer": 64, "generation.max_tokens": 64})
    assert str(err.value) == (
        "algorithm.overlong_buffer: algorithm.overlong_buffer (64) must be below generation.max_tokens (64)"
    )
