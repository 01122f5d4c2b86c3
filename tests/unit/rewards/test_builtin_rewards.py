"""The math_verify builtin reward against the real math-verify package: equivalent answers in any notation score
1, wrong ones 0, a pathological expression fails its own sample within its time limit, and the config's
`{builtin: math_verify}` builds it (with what it parsed logged per sample)."""

from __future__ import annotations

import sys
import time

import pytest

from tokenmill.config import RewardBuiltinConfig, RLConfig, load_config
from tokenmill.rewards.build import build_rewards
from tokenmill.rewards.builtin import MathVerifyReward
from tokenmill.types import ConfigError

TOWER = "\\boxed{999^{" + "9^" * 30 + "9}}"  # verifying it against a number never finishes on its own


def _cfg(*rewards):
    return load_config(RLConfig, {"model": {"path": "m"}, "data": {"path": "rows.jsonl"}, "rewards": list(rewards)})


def test_equivalent_answers_in_latex_boxed_or_plain_form_score_one_and_wrong_ones_zero():
    reward = MathVerifyReward()
    completions = ["so \\boxed{\\frac{1}{2}}", "The answer is $\\frac12$.", "0.5", "\\boxed{0.25}", "no idea"]
    assert reward(completions=completions, answer=["0.5"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert reward(completions=["\\boxed{2x+2}", "\\boxed{2x+3}"], answer=["$2(x+1)$"] * 2) == [1.0, 0.0]
    # a reference it cannot read abstains (None), as TRL's accuracy reward does
    assert reward(completions=["\\boxed{1}"], answer=[""]) == [None]


def test_a_pathological_expression_scores_zero_within_its_own_time_limit():
    reward = MathVerifyReward(timeout_s=1)
    start = time.monotonic()
    assert reward(completions=[TOWER, "\\boxed{7}"], answer=["7", "7"]) == [0.0, 1.0]
    assert time.monotonic() - start < 6  # parse + verify limits of 1 s each, not a hang


def test_the_column_is_configurable_and_logged_per_sample():
    reward = MathVerifyReward(column="solution")
    logged = {}
    out = reward(completions=[[{"role": "assistant", "content": "\\boxed{3}"}], "4"], solution=["3", "3"],
                 log_extra=lambda column, values: logged.setdefault(column, values))
    assert out == [1.0, 0.0]
    assert logged == {"parsed_answer": ["3", "4"]}
    with pytest.raises(KeyError, match="math_verify compares with the dataset column 'solution'"):
        reward(completions=["3"], answer=["3"])


def test_config_shapes_build_a_timed_out_function_reward():
    cfg = _cfg({"builtin": "math_verify"}, {"type": "builtin", "builtin": "math_verify", "name": "mv",
                                            "column": "solution", "timeout_s": 2, "weight": 0.5})
    assert [type(r) for r in cfg.rewards] == [RewardBuiltinConfig, RewardBuiltinConfig]
    rewards = build_rewards(cfg)
    try:
        first, second = rewards.rewards
        assert (first.name, first.weight, first.fn.column, first.fn.timeout_s) == ("math_verify", 1.0, "answer", 5)
        assert (second.name, second.weight, second.fn.column, second.fn.timeout_s) == ("mv", 0.5, "solution", 2)
        totals, details = rewards.score(["q", "q"], ["\\boxed{\\frac{1}{2}}", "1"], {"answer": ["0.5", "0.5"],
                                                                                  "solution": ["1", "1"]})
        assert totals == [1.0 + 0.5 * 0.0, 0.0 + 0.5 * 1.0]
        assert details[0]["math_verify"].extra == {"parsed_answer": "\\frac{1}{2}"}
    finally:
        rewards.close()


@pytest.mark.parametrize(("reward", "message"), [
    ({"builtin": "mathverify"}, "rewards.0.builtin: Input should be 'math_verify' (got 'mathverify')"),
    ({"builtin": "math_verify", "colum": "x"}, "rewards.0.colum: unknown field; did you mean column?"),
    ({"builtin": "math_verify", "timeout_s": 0}, "rewards.0.timeout_s: Input should be greater than or equal to 1"),
])
def test_bad_builtin_settings_name_the_field(reward, message):
    with pytest.raises(ConfigError) as err:
        _cfg(reward)
    assert str(err.value).startswith(message), str(err.value)


def test_other_reward_kinds_still_parse_beside_it():
    cfg = _cfg({"function": "tokenmill.data.tasks:addition_reward"}, {"path": "rm"}, {"builtin": "math_verify"})
    assert [r.type for r in cfg.rewards] == ["function", "model", "builtin"]


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError) as err:
        build_rewards(_cfg({"builtin": "math_verify"}))
    assert str(err.value) == "rewards: the math_verify reward needs the math-verify package: pip install tokenmill[tasks]"


def test_the_run_check_names_a_missing_answer_column(tmp_path):
    from tokenmill.config.preflight import check_run

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1/2 as a decimal?", "solution": "0.5"}\n')
    cfg = load_config(RLConfig, {"model": {"path": "m"}, "data": {"path": str(rows)},
                                 "rewards": [{"builtin": "math_verify"}]})
    with pytest.raises(ConfigError, match=r"^rewards.0.column: math_verify\(\) needs the dataset column\(s\) "
                       r"'answer', which the dataset lacks \(columns: prompt, solution\)"):
        check_run(cfg)
    cfg.rewards[0].column = "solution"
    assert not [p for p in check_run(cfg) if p.startswith("rewards")]
