"""Reward functions (TRL signature) under timeouts and isolation, weighted sets, and a reward model."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from tokenmill.rewards import FunctionReward, ModelReward, RewardSet
from tokenmill.types import RewardResult

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", " 6 "]
COLUMNS = {"answer": ["2", "4", "6"], "level": [1, 2, 3]}


# ---------------------------------------------------------------------------------- reward functions
# (module level: the process worker inherits them through fork, and they read like user code)

def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def length_score(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def only_answer(prompts, completions, answer):  # no **kwargs: must not receive `level`
    return [1.0 if c.strip() == a else -1.0 for c, a in zip(completions, answer)]


def raises(prompts, completions, **kwargs):
    raise ValueError("bad reward")


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def odd_values(prompts, completions, **kwargs):
    return [float("nan"), float("inf"), "high", 0.5, None, -float("inf")][: len(completions)]


def sleep_30(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


_RELEASE = threading.Event()


def wait_30(prompts, completions, **kwargs):
    # a 30 s sleep that the test can cut short afterwards, so the abandoned thread does not hold up exit
    _RELEASE.wait(30)
    return [1.0] * len(completions)


def pid_or_spin(prompts, completions, spin, **kwargs):
    if spin[0]:
        while True:
            pass
    return [float(os.getpid())] * len(completions)


def hard_exit(prompts, completions, **kwargs):
    os._exit(3)


def per_sample_exact(prompt, completion, answer, **row):
    return 1.0 if completion.strip() == answer else 0.0


def per_sample_strict(prompt, completion, answer):
    return 1.0 if completion.strip() == answer else 0.0


def numpy_like(prompts, completions, **kwargs):
    import numpy as np

    return np.array([0.25] * len(completions), dtype=np.float32)


ISOLATIONS = ["process", "thread"]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_trl_style_function_scores(isolation):
    reward = FunctionReward(correct, isolation=isolation, timeout_s=5)
    try:
        assert reward.name == "correct" and reward.weight == 1.0
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        assert out == [RewardResult(1.0), RewardResult(0.0), RewardResult(1.0)]
        # the same worker serves a second call
        assert [r.value for r in reward(PROMPTS[:1], ["3"], {"answer": ["3"], "level": [1]})] == [1.0]
    finally:
        reward.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_raising_function_gives_none_with_the_exception_type(isolation):
    reward = FunctionReward(raises, isolation=isolation, timeout_s=5)
    try:
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        assert len(out) == 3
        assert all(r.value is None for r in out)
        assert all("ValueError" in r.error and "bad reward" in r.error for r in out)
        # the failure does not poison the worker
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        assert all("ValueError" in r.error for r in out)
    finally:
        reward.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_wrong_length_gives_none_naming_the_lengths(isolation):
    reward = FunctionReward(wrong_length, isolation=isolation, timeout_s=5)
    try:
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        assert [r.value for r in out] == [None, None, None]
        assert all("1" in r.error and "3" in r.error for r in out)
        assert out[0].error.startswith("returned 1 values for 3 completions; wrong_length (")
        assert out[0].error.endswith(f"{__file__}:{wrong_length.__code__.co_firstlineno})")  # the user's def
    finally:
        reward.close()


def test_non_numbers_fail_only_their_sample():
    reward = FunctionReward(odd_values, isolation="thread")
    out = reward(["p"] * 6, ["c"] * 6, {})
    assert [r.value for r in out] == [None, None, None, 0.5, None, None]
    assert "non-finite" in out[0].error and "non-finite" in out[1].error and "non-finite" in out[5].error
    assert "not a number" in out[2].error and "'high'" in out[2].error
    assert out[3].error is None
    assert out[4] == RewardResult(None)  # an explicit None abstains: no error
    where = f"; odd_values ({__file__}:{odd_values.__code__.co_firstlineno})"  # the user's def, as for a wrong length
    assert out[0].error == f"non-finite value nan{where}"
    assert out[2].error == f"returned the string 'high', not a number (return float(...) if meant){where}"


def test_array_results_are_accepted():
    reward = FunctionReward(numpy_like, isolation="process")
    try:
        assert reward(PROMPTS, COMPLETIONS, COLUMNS) == [RewardResult(0.25)] * 3
    finally:
        reward.close()


def test_sleeping_function_times_out_in_a_process():
    reward = FunctionReward(sleep_30, isolation="process", timeout_s=1)
    try:
        start = time.monotonic()
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        elapsed = time.monotonic() - start
        assert elapsed < 4.5  # at most three timeouts: the batch's, then two samples'
        assert all(r.value is None and "within 1s" in r.error for r in out)
    finally:
        reward.close()


def test_sleeping_function_times_out_in_a_thread():
    _RELEASE.clear()
    reward = FunctionReward(wait_30, isolation="thread", timeout_s=1)
    try:
        start = time.monotonic()
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        elapsed = time.monotonic() - start
        assert 0.9 < elapsed < 4.5
        assert all(r.value is None and "within 1s" in r.error for r in out)
    finally:
        _RELEASE.set()
        reward.close()


def test_busy_loop_worker_is_killed_and_replaced():
    reward = FunctionReward(pid_or_spin, isolation="process", timeout_s=1)
    try:
        [first] = reward(["p"], ["c"], {"spin": [False]})
        worker = int(first.value)
        assert worker != os.getpid()
        os.kill(worker, 0)  # alive between calls

        start = time.monotonic()
        [spun] = reward(["p"], ["c"], {"spin": [True]})
        assert time.monotonic() - start < 3.0
        assert spun.value is None and "within 1s" in spun.error
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(worker, 0)

        again = reward(["p", "q"], ["c", "d"], {"spin": [False, False]})
        assert again[0].value == again[1].value
        assert int(again[0].value) not in (worker, os.getpid())  # a fresh worker
    finally:
        reward.close()


def test_worker_that_exits_is_reported_and_restarted():
    reward = FunctionReward(hard_exit, isolation="process", timeout_s=5)
    try:
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)
        assert all(r.value is None and "worker died" in r.error for r in out)
        out = reward(PROMPTS, COMPLETIONS, COLUMNS)  # a fresh worker, which dies again the same way
        assert all("worker died" in r.error for r in out)
    finally:
        reward.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_per_sample_wrapper(isolation):
    reward = FunctionReward(per_sample_exact, per_sample=True, isolation=isolation, timeout_s=5)
    try:
        assert [r.value for r in reward(PROMPTS, COMPLETIONS, COLUMNS)] == [1.0, 0.0, 1.0]
    finally:
        reward.close()


def test_per_sample_function_gets_only_the_columns_it_names():
    reward = FunctionReward(per_sample_strict, per_sample=True, isolation="thread")
    assert [r.value for r in reward(PROMPTS, COMPLETIONS, COLUMNS)] == [1.0, 0.0, 1.0]


def test_per_sample_with_a_completion_column():
    columns = {"answer": ["2", "4", "6"], "completion": ["2", "4", "6"]}
    reward = FunctionReward(per_sample_exact, per_sample=True, isolation="thread")
    assert [r.value for r in reward(PROMPTS, COMPLETIONS, columns)] == [1.0, 0.0, 1.0]


def test_kwargs_filtering_passes_only_named_columns():
    # only_answer has no **kwargs: given `level` too it would raise TypeError
    reward = FunctionReward(only_answer, isolation="thread")
    assert [r.value for r in reward(PROMPTS, COMPLETIONS, COLUMNS)] == [1.0, -1.0, 1.0]
    # a function with **kwargs gets every column
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    FunctionReward(spy, isolation="thread")(PROMPTS, COMPLETIONS, COLUMNS)
    assert sorted(seen) == ["answer", "level", "log_extra", "log_metric", "trainer_state"]
    assert {k: seen[k] for k in COLUMNS} == COLUMNS


def test_reward_set_weighted_total():
    r1 = FunctionReward(correct, weight=2.0, isolation="thread")
    r2 = FunctionReward(length_score, weight=-0.5, isolation="thread")
    totals, details = RewardSet([r1, r2]).score(PROMPTS, COMPLETIONS, COLUMNS)
    # correct = 1, 0, 1; length = 1, 1, 3  ->  2*r1 - 0.5*r2
    assert totals == [2.0 - 0.5, 0.0 - 0.5, 2.0 - 1.5]
    assert [d["correct"].value for d in details] == [1.0, 0.0, 1.0]
    assert [d["length_score"].value for d in details] == [1.0, 1.0, 3.0]


def test_reward_set_none_abstains_and_all_none_is_nan():
    r1 = FunctionReward(correct, weight=2.0, isolation="thread")
    r3 = FunctionReward(odd_values, weight=10.0, isolation="thread")  # NaN, inf, 'high' -> all None for 3
    totals, details = RewardSet([r1, r3]).score(PROMPTS, COMPLETIONS, COLUMNS)
    assert totals == [2.0, 0.0, 2.0]  # the failed function is left out, not counted as 0
    assert all(d["odd_values"].value is None for d in details)
    failing = RewardSet([FunctionReward(raises, isolation="thread"), FunctionReward(wrong_length, isolation="thread")])
    totals, _ = failing.score(PROMPTS, COMPLETIONS, COLUMNS)
    assert len(totals) == 3 and all(math.isnan(t) for t in totals)


def test_reward_set_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        RewardSet([FunctionReward(correct, isolation="thread"), FunctionReward(correct, isolation="thread")])
    named = RewardSet([FunctionReward(correct, isolation="thread"),
                       FunctionReward(correct, name="correct_again", isolation="thread")])
    assert [r.name for r in named.rewards] == ["correct", "correct_again"]


# ------------------------------------------------------------------------------------------ reward model

@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tokenmill.testing import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # make the scores clearly distinct
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@torch.no_grad()
def _direct_score(path, text):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")["input_ids"]
    return model(input_ids=ids).logits[0, 0].item()


def test_model_reward_equals_direct_logits(reward_model_path):
    reward = ModelReward(reward_model_path, batch_size=2, weight=0.5)
    assert reward.name == "rm" and reward.weight == 0.5
    completions = ["2", "five hundred", "6"]  # different lengths: right padding inside a batch
    out = reward(PROMPTS, completions, {})
    expected = [_direct_score(reward_model_path, p + c) for p, c in zip(PROMPTS, completions)]
    assert [r.value for r in out] == pytest.approx(expected, abs=1e-5)
    assert len({round(v, 4) for v in expected}) == 3
    assert all(r.error is None for r in out)


def test_model_reward_chat_prompt(reward_model_path):
    from transformers import AutoTokenizer

    reward = ModelReward(reward_model_path)
    messages = [{"role": "user", "content": "1+1="}]
    [out] = reward([messages], ["2"], {})
    text = AutoTokenizer.from_pretrained(reward_model_path).apply_chat_template(
        messages + [{"role": "assistant", "content": "2"}], tokenize=False)
    assert text == "<|user|>1+1=<|end|><|assistant|>2<|end|>"
    assert out.value == pytest.approx(_direct_score(reward_model_path, text), abs=1e-5)


def test_model_reward_needs_one_label(tmp_path, reward_model_path):
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(reward_model_path)
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(reward_model_path).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="2 labels, expected 1"):
        ModelReward(str(tmp_path / "two"))


def test_positional_parameter_names_fail_naming_what_is_given():
    def old_style(p, c, **kwargs):  # positional names: TRL passes everything by keyword, so this cannot be called
        return [1.0] * len(c)

    [out] = FunctionReward(old_style, isolation="thread")(["1+1="], ["2"], {"answer": ["2"]})
    assert out.value is None
    assert out.error.startswith(
        "TypeError: missing a required argument: 'p'; reward functions are called by keyword as TRL calls them, "
        "given: answer, completions, log_extra, log_metric, prompts, trainer_state")


def returns_text(prompts, completions, **kwargs):
    return "1.0"


def returns_generator(prompts, completions, **kwargs):
    return (0.5 for _ in completions)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_string_is_not_a_list_and_a_generator_is(isolation):
    text = FunctionReward(returns_text, isolation=isolation)
    gen = FunctionReward(returns_generator, isolation=isolation)
    try:
        out = text(["p"] * 3, ["c"] * 3, {})
        assert [r.value for r in out] == [None] * 3
        assert all(r.error.startswith("returned str, expected a list; returns_text (") for r in out)
        assert gen(["p"] * 3, ["c"] * 3, {}) == [RewardResult(0.5)] * 3
    finally:
        text.close()
        gen.close()
