"""A reward that fails on every sample stops the run after `health.alarms.reward_failures.window` steps,
naming the function and its first error; one that fails on some samples does not."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

import tokenmill
from tokenmill.rewards.watch import RewardFailureError, RewardFailureWatch
from tokenmill.types import Group, Sample, StopReason

# ------------------------------------------------------------------------------------- the watch alone


def _step(values: list[float | None], errors: list[str | None], name: str = "r") -> list[Group]:
    samples = [
        Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0), prompt_len=1, prompt="p", completion="c",
               stop_reason=StopReason.STOP, version=0, group_id=0, reward=math.nan if v is None else v,
               rewards={name: v}, reward_errors={name: e} if e else {})
        for v, e in zip(values, errors, strict=True)
    ]
    return [Group(0, tuple(samples))]


FAILED = _step([None, None], ["ValueError: bad at r.py:3", "ValueError: worse at r.py:3"])
SCORED_ONE = _step([None, 0.5], ["ValueError: bad at r.py:3", None])
ABSTAINED = _step([None, None], [None, None])


def test_stops_at_the_kth_consecutive_failed_step_with_the_first_error():
    watch = RewardFailureWatch(3)
    watch.check(1, SCORED_ONE)
    watch.check(2, FAILED)
    watch.check(3, FAILED)
    with pytest.raises(RewardFailureError) as err:
        watch.check(4, _step([None], ["TimeoutError:\nno result\nwithin 1s"]))
    assert str(err.value) == (
        "reward 'r' failed on every sample in 3 consecutive steps (2-4); first error: ValueError: bad at r.py:3. "
        "Fix or remove the function (health.alarms.reward_failures.policy: off turns this check off)")


def test_a_scored_sample_or_a_step_of_abstentions_ends_the_streak():
    watch = RewardFailureWatch(2)
    for step, groups in enumerate([FAILED, SCORED_ONE, FAILED, ABSTAINED, FAILED, SCORED_ONE], start=1):
        watch.check(step, groups)  # never two failed steps in a row
    with pytest.raises(RewardFailureError, match=r"in 2 consecutive steps \(7-8\)"):
        watch.check(7, FAILED)
        watch.check(8, FAILED)


def test_zero_never_stops():
    watch = RewardFailureWatch(0)
    for step in range(1, 20):
        watch.check(step, FAILED)


# ------------------------------------------------------------------------------------------- real runs

REWARDS = '''
def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def always_raises(prompts, completions, **kwargs):
    raise KeyError("no column named solution")


def always_nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def hangs(prompts, completions, **kwargs):
    import time

    time.sleep(30)


def fails_on_half(prompts, completions, **kwargs):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]
'''


def _config(tmp_path, model: str, reward: str, steps: int, timeout_s: float = 10.0) -> dict:
    (tmp_path / "rewards.py").write_text(REWARDS)
    return {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 100, "num_eval": 0},
        "rewards": [{"function": f"{tmp_path / 'rewards.py'}:digit_share"},
                    {"function": f"{tmp_path / 'rewards.py'}:{reward}", "timeout_s": timeout_s}],
        "generation": {"group_size": 2, "max_tokens": 3},
        "controller": {"steps": steps, "prompts_per_step": 2},
        "health": {"alarms": {"reward_failures": {"window": 3}}},
        "engine": {"threads": 1},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }


def _logged_steps(tmp_path) -> list[dict]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_cli_run_with_an_always_failing_reward_stops_at_step_k(tiny_model_path, tmp_path, capsys):
    from tokenmill.cli import main

    cfg = _config(tmp_path, tiny_model_path, "always_raises", steps=10)
    cfg["tracking"]["console"] = "plain"  # the console prints warnings, and must not print the stop line as well
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["train", str(tmp_path / "config.yaml")])
    out, err = capsys.readouterr()
    assert (out + err).count("failed on every sample") == 1
    err = err.strip().splitlines()
    assert code == 1
    assert err[-1] == (
        "tokenmill: reward 'always_raises' failed on every sample in 3 consecutive steps (1-3); first error: "
        f"KeyError: 'no column named solution' at {tmp_path / 'rewards.py'}:7. "
        "Fix or remove the function (health.alarms.reward_failures.policy: off turns this check off)")
    assert not any("Traceback" in line for line in err)
    steps = _logged_steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]  # steps 1-3 were logged, step 4 never ran
    assert all(r["reward/always_raises/failed"] == 4 for r in steps)


def test_a_reward_failing_on_some_samples_does_not_stop_the_run(tiny_model_path, tmp_path):
    result = tokenmill.train(_config(tmp_path, tiny_model_path, "fails_on_half", steps=4))
    steps = _logged_steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["reward/fails_on_half/failed"] == 2 and r["reward/fails_on_half/mean"] == 1.0 for r in steps)
    assert result["last_metrics"]["reward/fails_on_half/failed"] == 2


@pytest.mark.parametrize("reward, placement, error", [
    ("always_nan", "colocated", "non-finite value nan"),
    ("hangs", "colocated", "no result within 0.3s (worker killed)"),
    ("always_raises", "thread", "KeyError: 'no column named solution'"),  # async: the producer is shut down too
])
def test_nan_hanging_and_async_runs_stop_too(tiny_model_path, tmp_path, reward, placement, error):
    cfg = _config(tmp_path, tiny_model_path, reward, steps=10, timeout_s=0.3)
    cfg["engine"]["placement"] = placement
    cfg["health"]["alarms"]["reward_failures"]["window"] = 2
    with pytest.raises(RewardFailureError, match=rf"^reward '{reward}' failed on every sample in 2 consecutive steps "
                                                 rf"\(1-2\); first error: {re.escape(error)}"):
        tokenmill.train(cfg)
    assert [r["step"] for r in _logged_steps(tmp_path)] == [1, 2]
