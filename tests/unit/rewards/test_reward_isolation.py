"""A reward function's failures stay with the samples that cause them: a raise, a hang or a wrong length on
one sample fails that sample only; a failed score abstains within its group; failures are kept in the run's
events.jsonl naming the user's line; a numeric string is refused."""

from __future__ import annotations

import json
import math
import time

import pytest

from tokenmill.rewards import FunctionReward, RewardSet
from tokenmill.rewards.set import totals
from tokenmill.types import RewardResult

PROMPTS = [f"p{i}" for i in range(8)]
COMPLETIONS = ["ok", "ok", "ok", "BAD", "ok", "ok", "ok", "ok"]


def raises_on_bad(completions, **kwargs):
    for c in completions:
        if c == "BAD":
            raise ValueError("cannot score BAD")  # the line the error must name
    return [1.0] * len(completions)


RAISE_LINE = raises_on_bad.__code__.co_firstlineno + 3


def hangs_on_bad(completions, **kwargs):
    if "BAD" in completions:
        time.sleep(60)
    return [1.0] * len(completions)


def drops_bad(completions, **kwargs):
    return [1.0 for c in completions if c != "BAD"]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_raise_on_one_sample_fails_that_sample_only(isolation):
    reward = FunctionReward(raises_on_bad, isolation=isolation)
    try:
        out = reward(PROMPTS, COMPLETIONS, {})
    finally:
        reward.close()
    assert [r.value for r in out] == [1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0]
    # the error points at the user's raise, not at tokenmill's isolation code
    assert out[3].error == f"ValueError: cannot score BAD at {__file__}:{RAISE_LINE}"


def test_a_wrong_length_on_one_sample_fails_that_sample_only():
    reward = FunctionReward(drops_bad, isolation="thread")
    out = reward(PROMPTS, COMPLETIONS, {})
    assert [r.value for r in out] == [1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0]
    assert out[3].error == (f"returned 0 values for 1 completions; drops_bad "
                            f"({__file__}:{drops_bad.__code__.co_firstlineno})")


def test_a_hang_on_one_sample_costs_its_timeout_not_the_batch():
    reward = FunctionReward(hangs_on_bad, isolation="process", timeout_s=0.5)
    try:
        start = time.monotonic()
        first = reward(PROMPTS, COMPLETIONS, {})
        first_s = time.monotonic() - start
        start = time.monotonic()
        second = reward(PROMPTS, COMPLETIONS, {})  # scored one at a time from now on: one timeout, not two
        second_s = time.monotonic() - start
    finally:
        reward.close()
    for out in (first, second):
        assert [r.value for r in out] == [1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0]
        assert out[3].error.startswith("no result within 0.5s (worker killed); hangs_on_bad (")
    assert reward.one_at_a_time
    assert 1.0 <= first_s < 2.5  # the batch's timeout, then the hanging sample's
    assert 0.5 <= second_s < 1.5  # the hanging sample's only


def test_a_function_hanging_on_everything_spends_three_timeouts_per_batch():
    reward = FunctionReward(hangs_on_bad, isolation="process", timeout_s=0.3)
    try:
        start = time.monotonic()
        out = reward(["p"] * 6, ["BAD"] * 6, {})
        elapsed = time.monotonic() - start
    finally:
        reward.close()
    assert [r.value for r in out] == [None] * 6
    assert [r.error.split(";")[0] for r in out] == ["no result within 0.3s (worker killed)"] * 2 + [
        "not scored: 3 calls of this batch got no result within 0.3s"] * 4
    assert 0.9 <= elapsed < 2.0


def test_a_failed_score_abstains_within_its_group_and_none_adds_nothing():
    # two groups of three; correct: 0/1, format: 0.5 each, weight 2; format failed on sample 1, abstained on 4
    per_sample = [
        {"correct": RewardResult(0.0), "format": RewardResult(0.5)},
        {"correct": RewardResult(0.0), "format": RewardResult(None, "ValueError: x")},
        {"correct": RewardResult(1.0), "format": RewardResult(0.25)},
        {"correct": RewardResult(1.0), "format": RewardResult(0.5)},
        {"correct": RewardResult(0.0), "format": RewardResult(None)},
        {"correct": RewardResult(None, "boom"), "format": RewardResult(None, "boom")},
    ]
    weights = {"correct": 1.0, "format": 2.0}
    got = totals(per_sample, weights, [0, 0, 0, 1, 1, 1])
    # sample 1: format imputed as its group's mean (0.5 + 0.25) / 2, so it ranks with sample 0, not below it
    assert got[:5] == [1.0, 2 * 0.375, 1.5, 2.0, 0.0]
    assert math.isnan(got[5])  # nothing scored it: left out of training
    # the failed wrong answer is not penalised against the scored wrong answer of the same group
    same = totals(per_sample[:2], weights, [0, 0])
    assert same == [1.0, 1.0]


def test_a_reward_set_imputes_by_the_groups_it_is_given():
    reward = FunctionReward(raises_on_bad, isolation="thread")
    scores, details = RewardSet([reward]).score(["p"] * 4, ["ok", "BAD", "ok", "ok"], {}, group_ids=[0, 0, 1, 1])
    assert scores[0] == 1.0 and math.isnan(scores[1]) and scores[2:] == [1.0, 1.0]  # its only reward failed
    assert details[1]["raises_on_bad"].value is None


def numeric_strings(completions, **kwargs):
    return ["1", 1, "0.5", 2.5][: len(completions)]


def test_a_numeric_string_is_refused():
    out = FunctionReward(numeric_strings, isolation="thread")(["p"] * 4, ["c"] * 4, {})
    assert [r.value for r in out] == [None, 1.0, None, 2.5]
    assert out[0].error == ("returned the string '1', not a number (return float(...) if meant); "
                            f"numeric_strings ({__file__}:{numeric_strings.__code__.co_firstlineno})")


def test_failures_are_kept_in_the_run_folder_naming_the_users_line(tmp_path, tiny_model_path):
    import tokenmill

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "BAD", "answer": "0"}]

    def flaky(prompts, completions, **kwargs):
        if "BAD" in prompts:
            raise KeyError("no answer for BAD")
        return [0.5] * len(completions)

    line = flaky.__code__.co_firstlineno + 2
    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"path": "unused.jsonl", "num_eval": 0, "shuffle": False},
        "generation": {"group_size": 2, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    result = tokenmill.train(cfg, rewards=[flaky], dataset=rows)
    metrics = result["last_metrics"]
    assert metrics["reward/flaky/failed"] == 2 and metrics["reward/flaky/mean"] == 0.5  # the good row scored
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    [failed] = [e for e in events if e["event"] == "reward_failed"]
    assert (failed["reward"], failed["failed"], failed["samples"], failed["version"]) == ("flaky", 2, 4, 0)
    assert failed["errors"] == [{"error": f"KeyError: 'no answer for BAD' at {__file__}:{line}", "samples": 2}]


def correct(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_ok(completions, **kwargs):
    if "x" in completions:
        raise ValueError("cannot parse x")
    return [0.5 if c.isdigit() else 0.0 for c in completions]


def test_the_generator_imputes_a_failed_score_within_each_prompts_group(tokenizer):
    from tokenmill.rollout.generator import Generator, encode_prompts
    from tokenmill.types import Completion, SamplingParams, StopReason

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    texts = [["3", "x", "2"], ["a", "4", "b"]]  # 'x' is wrong and its format reward fails
    completions = [[Completion(tuple(tokenizer(t, add_special_tokens=False)["input_ids"]), (0.0,) * len(t),
                               StopReason.STOP, t) for t in group] for group in texts]
    rewards = RewardSet([FunctionReward(correct, isolation="thread"), FunctionReward(format_ok, isolation="thread")])
    generator = Generator(None, tokenizer, rewards, SamplingParams(n=3))
    groups = generator.score(rows, encode_prompts(tokenizer, [r["prompt"] for r in rows]), completions, version=0)
    # 'x' gets format = mean(0.5, 0.5) of its own group (not 0.3, the batch's), so it ties with '3'
    assert [s.reward for s in groups[0].samples] == [0.5, 0.5, 1.5]
    assert [s.reward for s in groups[1].samples] == [0.0, 1.5, 0.0]
    assert groups[0].samples[1].rewards == {"correct": 0.0, "format_ok": None}
    assert groups[0].samples[1].reward_errors["format_ok"].startswith("ValueError: cannot parse x at ")
