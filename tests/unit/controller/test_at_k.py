"""pass@k, avg@n and maj@k against hand-computed values: the unbiased estimator, its edge cases, majority
voting with its ties and non-answers, and the answer extractions."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from tokenmill.controller.at_k import (
    answer_extractor,
    at_k_metrics,
    boxed_answer,
    final_text,
    last_number,
    majority_correct,
    pass_at_k,
)
from tokenmill.types import ConfigError, Group, Sample, StopReason


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is c/n
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(4, 0, 2) == 0.0  # nothing correct: never
    assert pass_at_k(4, 4, 2) == 1.0  # all correct: always
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every draw of k holds a correct one
    # exact where the binomials overflow a float (C(2000, 500) ~ 1e486): against the rational value
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    exact = 1 - Fraction(math.comb(1995, 500), math.comb(2000, 500))
    assert pass_at_k(2000, 5, 500) == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(ValueError, match="k=4 needs at least k samples per prompt, got n=3"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="c=5 must be between 0 and n=3"):
        pass_at_k(3, 5, 1)


def test_majority_vote():
    correct = [False, True, True, False, False]
    assert majority_correct(["7", "8", "8", "7", "7"], correct, 5) is False  # "7" x3 beats "8" x2
    assert majority_correct(["7", "8", "8", "7", "7"], correct, 3) is True  # first three: "8" x2
    assert majority_correct(["8", "7", "7", "8"], [True, False, False, True], 4) is True  # tie: first seen
    assert majority_correct(["7", "8", "7", "8"], [False, True, False, True], 4) is False
    assert majority_correct([None, None, "8"], [False, False, True], 3) is True  # no answer, no vote
    assert majority_correct([None, None], [True, True], 2) is False  # nobody voted: wrong
    with pytest.raises(ValueError, match="k=3 needs 1 <= k <= the 2 samples"):
        majority_correct(["1", "2"], [True, False], 3)


def test_answer_extractions():
    assert boxed_answer(r"so \boxed{1} or rather \boxed{\frac{1}{2}} ") == r"\frac{1}{2}"
    assert boxed_answer("no box") is None and boxed_answer(r"\boxed{12") is None
    assert last_number("it is 1,234.5 then -7 items") == "-7" and last_number("1,234.5 apples") == "1234.5"
    assert last_number("none") is None
    assert answer_extractor(None, "addition")(" 42\n") == "42"
    assert answer_extractor(None, None)("   ") is None
    assert answer_extractor("boxed")(r"\boxed{3}") == "3"
    assert answer_extractor("tokenmill.controller.at_k:last_number")("x 5") == "5"
    with pytest.raises(ConfigError, match="controller.eval_answer: module 'tokenmill.controller.at_k' has no"):
        answer_extractor("tokenmill.controller.at_k:nope")


def _sample(text: str, reward: float, messages=None, episode: bool = True) -> Sample:
    row = {"messages": messages, **({"turns": 2, "info": {}} if episode else {})} if messages else {}
    return Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0), prompt_len=1, prompt="p",
                  completion=text, stop_reason=StopReason.STOP, reward=reward, row=row)


def test_metrics_over_hand_made_groups():
    # prompt A: 2 of 4 correct, answers 5,5,6,6 (tie: "5" first, and "5" is wrong); prompt B: 1 of 4 correct
    # with the majority "9" right; prompt C: none correct
    a = [_sample(" 5", 0.0), _sample("5", 0.0), _sample("6 ", 1.0), _sample("6", 1.0)]
    b = [_sample("9", 1.0), _sample("8", 0.0), _sample("9", float("nan")), _sample("1", 0.0)]
    c = [_sample("x", 0.0)] * 4
    out = at_k_metrics([Group(0, tuple(a)), Group(1, tuple(b)), Group(2, tuple(c))], [1, 2, 4],
                       lambda s: s.reward == 1.0, answer_extractor(None))
    assert out["eval/pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)
    assert out["eval/pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6) + 0) / 3)  # 1 - C(n-c,2)/C(4,2)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/avg@4"] == pytest.approx(out["eval/pass@1"])  # pass@1 from n samples is their mean
    assert out["eval/avg_reward@4"] == pytest.approx(3 / 11)  # the NaN total is left out
    # maj@1: the first sample; maj@2: A "5" (wrong), B tie "9"/"8" -> "9" (right); maj@4: A tie -> "5" wrong
    assert out["eval/maj@1"] == pytest.approx(1 / 3)
    assert out["eval/maj@2"] == pytest.approx(1 / 3)
    assert out["eval/maj@4"] == pytest.approx(1 / 3)
    assert out["eval/samples_per_prompt"] == 4
    with pytest.raises(ValueError, match="same number of samples"):
        at_k_metrics([Group(0, tuple(a)), Group(1, tuple(b[:2]))], [1], lambda s: True, answer_extractor(None))


def test_an_episode_votes_with_its_last_assistant_message():
    messages = [{"role": "user", "content": "1-7"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "higher"}, {"role": "assistant", "content": " 6"}]
    assert final_text(_sample("4<|end|>6<|end|>", 1.0, messages)) == " 6"
    assert final_text(_sample("plain", 1.0)) == "plain"
    assert final_text(_sample("mine", 1.0, messages, episode=False)) == "mine"  # a dataset's column: not an answer
