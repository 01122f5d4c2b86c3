"""On-policy distillation's per-token advantages, the loss they give, and top-k bucketing, against numbers
computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.algorithms import ppo_clip_loss
from tokenmill.algorithms.distill import (
    bucketed_logprobs,
    bucketed_reverse_kl,
    distill_advantages,
    mixture_logprobs,
)

F64 = torch.float64

# one sequence: 2 prompt tokens, 2 completion tokens
STUDENT = [[0.0, 0.0, -0.5, -1.0]]
TEACHER = [[-9.0, -9.0, -1.5, -0.25]]  # prompt positions hold anything: the mask drops them
MASK = [[0, 0, 1, 1]]


def test_advantage_is_minus_the_log_ratio_times_kl_coef():
    adv = distill_advantages(torch.tensor(STUDENT, dtype=F64), torch.tensor(TEACHER, dtype=F64),
                             torch.tensor(MASK), kl_coef=0.5)
    # -0.5 * (-0.5 - -1.5) = -0.5 ; -0.5 * (-1.0 - -0.25) = 0.375
    assert adv.tolist() == [[0.0, 0.0, -0.5, 0.375]]


def test_task_advantage_mixes_in_on_completion_tokens_only():
    adv = distill_advantages(torch.tensor(STUDENT, dtype=F64), torch.tensor(TEACHER, dtype=F64),
                             torch.tensor(MASK), kl_coef=0.5, task_advantages_B=torch.tensor([2.0], dtype=F64),
                             task_weight=0.1)
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, -0.3, 0.575], abs=1e-12)


def test_per_token_loss_and_gradient_equal_hand_computed_values():
    """On-policy (ratio 1) with token_mean weights 1/2: loss = -(A_2 + A_3) / 2 and d loss / d logp_t =
    -A_t * w_t: each token is pushed by its own reverse-KL advantage."""
    adv = distill_advantages(torch.tensor(STUDENT, dtype=F64), torch.tensor(TEACHER, dtype=F64),
                             torch.tensor(MASK), kl_coef=1.0)
    assert adv.tolist() == [[0.0, 0.0, -1.0, 0.75]]
    logprobs = torch.tensor(STUDENT, dtype=F64, requires_grad=True)
    weights = torch.tensor([[0.0, 0.0, 0.5, 0.5]], dtype=F64)
    loss, _ = ppo_clip_loss(logprobs, torch.tensor(STUDENT, dtype=F64), adv, weights)
    assert loss.item() == pytest.approx(-(-1.0 + 0.75) / 2, abs=1e-12)  # 0.125
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.5, -0.375], abs=1e-12)


# a 4-token vocabulary at one position; the teacher lists its top 2 (ids 1 and 2)
P_STUDENT = [0.5, 0.25, 0.15, 0.10]
P_TEACHER = [0.1, 0.6, 0.2, 0.1]
TOP = [1, 2]


def _bucketed(sampled: int) -> tuple[float, float]:
    ids = torch.tensor([[TOP]])
    teacher_top = torch.tensor([[[math.log(P_TEACHER[i]) for i in TOP]]], dtype=F64)
    student_top = torch.tensor([[[math.log(P_STUDENT[i]) for i in TOP]]], dtype=F64)
    s, t = bucketed_logprobs(torch.tensor([[sampled]]), ids, teacher_top, student_top,
                             torch.tensor([[math.log(P_STUDENT[sampled])]], dtype=F64))
    return s.item(), t.item()


def test_a_sampled_token_in_the_top_k_keeps_its_own_logprobs():
    assert _bucketed(1) == pytest.approx((math.log(0.25), math.log(0.6)))
    assert _bucketed(2) == pytest.approx((math.log(0.15), math.log(0.2)))


def test_a_sampled_token_outside_the_top_k_is_the_other_bucket():
    # other = ids {0, 3}: student 0.5 + 0.1 = 0.6, teacher 0.1 + 0.1 = 0.2
    assert _bucketed(0) == pytest.approx((math.log(0.6), math.log(0.2)))
    assert _bucketed(3) == pytest.approx((math.log(0.6), math.log(0.2)))


def test_bucketed_estimate_is_unbiased_for_the_coarsened_kl_and_below_the_full_kl():
    expected = sum(p * (s - t) for p, (s, t) in zip(P_STUDENT, map(_bucketed, range(4)), strict=True))
    coarse = 0.25 * math.log(0.25 / 0.6) + 0.15 * math.log(0.15 / 0.2) + 0.6 * math.log(0.6 / 0.2)
    full = sum(p * math.log(p / q) for p, q in zip(P_STUDENT, P_TEACHER, strict=True))
    assert expected == pytest.approx(coarse, abs=1e-12)
    assert 0 < coarse < full


def test_pads_in_a_short_top_k_list_hold_no_mass():
    ids = torch.tensor([[[1, -1]]])
    teacher_top = torch.tensor([[[math.log(0.6), -math.inf]]], dtype=F64)
    student_top = torch.tensor([[[math.log(0.25), -math.inf]]], dtype=F64)
    s, t = bucketed_logprobs(torch.tensor([[0]]), ids, teacher_top, student_top, torch.tensor([[0.0]], dtype=F64))
    assert (s.item(), t.item()) == pytest.approx((math.log(0.75), math.log(0.4)))


def test_bucketed_reverse_kl_and_its_gradient_equal_hand_computed_values():
    """The exact coarsened KL of the example above, 0.25 ln(0.25/0.6) + 0.15 ln(0.15/0.2) + 0.6 ln(0.6/0.2),
    and its gradient in the student's logprobs a_k of the listed tokens: with p_other = 1 - sum_k e^a_k,
    d/d a_k = p_k (ln(p_k / q_k) + 1) - p_k (ln(p_other / q_other) + 1) = p_k (ln(p_k / q_k) - ln(p_other / q_other))."""
    student = torch.tensor([[math.log(0.25), math.log(0.15), 0.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[math.log(0.6), math.log(0.2), -math.inf]], dtype=F64)  # a padded third slot
    kl = bucketed_reverse_kl(student, teacher)
    coarse = 0.25 * math.log(0.25 / 0.6) + 0.15 * math.log(0.15 / 0.2) + 0.6 * math.log(0.6 / 0.2)
    assert kl.item() == pytest.approx(coarse, abs=1e-12)
    kl.sum().backward()
    other = math.log(0.6 / 0.2)
    want = [0.25 * (math.log(0.25 / 0.6) - other), 0.15 * (math.log(0.15 / 0.2) - other), 0.0]
    assert student.grad[0].tolist() == pytest.approx(want, abs=1e-12)


def test_bucketed_reverse_kl_over_the_whole_vocabulary_is_the_full_kl():
    student = torch.log(torch.tensor([P_STUDENT], dtype=F64))
    teacher = torch.log(torch.tensor([P_TEACHER], dtype=F64))
    full = sum(p * math.log(p / q) for p, q in zip(P_STUDENT, P_TEACHER, strict=True))
    assert bucketed_reverse_kl(student, teacher).item() == pytest.approx(full, abs=1e-9)  # other: floored at 1e-12


def test_mixture_of_teachers_is_the_log_of_the_mean_probability():
    lp = torch.log(torch.tensor([[[0.2, 0.5]], [[0.6, 0.1]]], dtype=F64))
    assert mixture_logprobs(lp).exp()[0].tolist() == pytest.approx([0.4, 0.3])
