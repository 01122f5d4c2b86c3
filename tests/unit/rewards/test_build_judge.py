"""`type: judge` in a config: validated with messages naming the field, built into a `JudgeReward`."""

from __future__ import annotations

import sys

import pytest

from tokenmill.config import load_config
from tokenmill.config.schema import RLConfig
from tokenmill.rewards.build import build_rewards
from tokenmill.rewards.judge import JudgeReward
from tokenmill.types import ConfigError


def config(tmp_path, **judge) -> dict:
    return {"model": {"path": "unused"}, "data": {"task": "addition", "num_train": 4},
            "rewards": [{"type": "judge", "url": "http://127.0.0.1:9/v1", "model": "m", **judge}],
            "tracking": {"output_dir": str(tmp_path / "run")}}


def test_a_judge_reward_is_built_from_its_config(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    cfg = RLConfig.model_validate(config(tmp_path, name="grader", rubric="correct?", weight=0.5, concurrency=3,
                                         timeout_s=2, retries=4, api_key_env="JUDGE_KEY", cache="disk"))
    rewards = build_rewards(cfg)
    try:
        [judge] = rewards.rewards
        assert isinstance(judge, JudgeReward)
        assert (judge.name, judge.weight, judge.concurrency, judge.timeout_s, judge.retries, judge.api_key) == (
            "grader", 0.5, 3, 2.0, 4, "sk-test")
        assert judge.cache.path == tmp_path / "run" / "judge_cache" / "grader.jsonl"
    finally:
        rewards.close()


@pytest.mark.parametrize(("judge", "message"), [
    ({"rubric": ""}, "rubric: give the criteria"),
    ({"rubric": "r", "url": "127.0.0.1:8000"}, "url must start with http"),
    ({"rubric": "r", "score_range": [5, 1]}, "score_range must be [low, high]"),
    ({"rubric": "r", "score_pattern": "Score: \\d+"}, "score_pattern needs a group"),
    ({"rubric": "r", "mode": "elo"}, "rewards.0.mode"),
    ({"rubric": "r", "concurrency": 0}, "rewards.0.concurrency"),
])
def test_bad_judge_configs_are_refused_naming_the_field(tmp_path, judge, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(RLConfig, config(tmp_path, **judge))


def test_building_checks_the_prompt_the_api_key_and_the_package(tmp_path, monkeypatch):
    bad = RLConfig.model_validate(config(tmp_path, prompt="{question} {answer}"))
    with pytest.raises(ConfigError, match=r"rewards\.0\.prompt: unknown field\(s\) \['answer'\]"):
        build_rewards(bad)
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    keyless = RLConfig.model_validate(config(tmp_path, rubric="r", api_key_env="NO_SUCH_KEY"))
    with pytest.raises(ConfigError, match="rewards.0.api_key_env: the environment variable NO_SUCH_KEY is not set"):
        build_rewards(keyless)
    monkeypatch.setitem(sys.modules, "openai", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"rewards\.0: .*pip install tokenmill\[judge\]"):
        build_rewards(RLConfig.model_validate(config(tmp_path, rubric="r")))
