"""Advantage estimators on hand-computed groups."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.algorithms import ADVANTAGES, assign_advantages, grpo_advantages, rloo_advantages
from tokenmill.types import Group, Sample, StopReason

NAN = float("nan")


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_uses_unbiased_std_and_eps():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.577350...; A = +-0.5 / (0.577350 + 1e-4)
    adv = grpo_advantages(t([1.0, 0.0, 0.0, 1.0]))
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-4)
    assert a == pytest.approx(0.86588, abs=1e-5)
    torch.testing.assert_close(adv, t([a, -a, -a, a]), rtol=0, atol=1e-12)


def test_grpo_uneven_group_by_hand():
    # rewards 3, 1, 2: mean 2, unbiased std = sqrt((1 + 1 + 0) / 2) = 1
    adv = grpo_advantages(t([3.0, 1.0, 2.0]), eps=0.0)
    torch.testing.assert_close(adv, t([1.0, -1.0, 0.0]), rtol=0, atol=1e-12)
    adv_eps = grpo_advantages(t([3.0, 1.0, 2.0]))
    torch.testing.assert_close(adv_eps, t([1 / 1.0001, -1 / 1.0001, 0.0]), rtol=0, atol=1e-12)


def test_grpo_without_scaling_is_mean_centred_only():
    adv = grpo_advantages(t([4.0, 0.0, 2.0, 2.0]), scale_rewards=False)
    torch.testing.assert_close(adv, t([2.0, -2.0, 0.0, 0.0]), rtol=0, atol=1e-12)


def test_grpo_equal_rewards_give_zero():
    assert grpo_advantages(t([0.5, 0.5, 0.5])).tolist() == [0.0, 0.0, 0.0]
    # 0.7 is not exact in binary: the mean is off by ~1e-16, divided by std + eps ~ 1e-4
    assert grpo_advantages(t([0.7, 0.7, 0.7])).abs().max().item() < 1e-9


def test_grpo_nan_rewards_get_zero_and_are_left_out_of_stats():
    # valid rewards 1, 0 (mean 0.5, unbiased std sqrt(0.5) = 0.70711); the NaN ones get 0
    adv = grpo_advantages(t([1.0, NAN, 0.0, NAN]))
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, t([a, 0.0, -a, 0.0]), rtol=0, atol=1e-12)
    assert not torch.isnan(adv).any()


@pytest.mark.parametrize("rewards", [[NAN, NAN, 1.0], [5.0], [NAN], []])
def test_group_with_fewer_than_two_valid_gets_zeros(rewards):
    for fn in (grpo_advantages, rloo_advantages):
        adv = fn(t(rewards))
        assert adv.shape == (len(rewards),)
        assert adv.tolist() == [0.0] * len(rewards)


def test_rloo_is_reward_minus_mean_of_others():
    # A_0 = 1 - (0 + 0 + 3)/3 = 0; A_1 = 0 - 4/3; A_2 = 0 - 4/3; A_3 = 3 - 1/3
    adv = rloo_advantages(t([1.0, 0.0, 0.0, 3.0]))
    torch.testing.assert_close(adv, t([0.0, -4 / 3, -4 / 3, 8 / 3]), rtol=0, atol=1e-12)
    # same thing as G/(G-1) * (r - mean)
    torch.testing.assert_close(adv, 4 / 3 * (t([1.0, 0.0, 0.0, 3.0]) - 1.0), rtol=0, atol=1e-12)


def test_rloo_skips_nan():
    adv = rloo_advantages(t([2.0, NAN, 0.0, 1.0]))
    # valid 2, 0, 1: A = 2 - 0.5, 0 - 1.5, 1 - 1
    torch.testing.assert_close(adv, t([1.5, 0.0, -1.5, 0.0]), rtol=0, atol=1e-12)


def test_registry_names():
    assert ADVANTAGES["grpo"] is grpo_advantages
    assert ADVANTAGES["rloo"] is rloo_advantages


def _sample(reward: float, group_id: int) -> Sample:
    return Sample(
        tokens=(1, 2, 3), loss_mask=(0, 1, 1), logprobs=(0.0, -1.0, -1.0), prompt_len=1, prompt="p",
        completion="c", stop_reason=StopReason.STOP, group_id=group_id, reward=reward,
    )


def test_assign_advantages_per_group():
    groups = [
        Group(0, tuple(_sample(r, 0) for r in [1.0, 0.0, 0.0, 1.0])),
        Group(1, tuple(_sample(r, 1) for r in [2.0, 2.0])),
        Group(2, tuple(_sample(r, 2) for r in [3.0, NAN, 1.0])),
    ]
    out = assign_advantages(groups, "grpo")
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-4)
    b = 1.0 / (math.sqrt(2.0) + 1e-4)  # valid 3, 1: mean 2, std sqrt(2)
    assert [g.group_id for g in out] == [0, 1, 2]
    assert [s.advantage for s in out[0].samples] == pytest.approx([a, -a, -a, a], abs=1e-12)
    assert [s.advantage for s in out[1].samples] == [0.0, 0.0]
    assert [s.advantage for s in out[2].samples] == pytest.approx([b, 0.0, -b], abs=1e-12)
    # everything else is carried over unchanged; the inputs are not touched (frozen records)
    assert out[0].samples[0].tokens == (1, 2, 3) and out[0].samples[0].reward == 1.0
    assert all(s.advantage == 0.0 for g in groups for s in g.samples)


def test_assign_advantages_passes_kwargs():
    groups = [Group(0, tuple(_sample(r, 0) for r in [4.0, 0.0]))]
    out = assign_advantages(groups, "grpo", scale_rewards=False)
    assert [s.advantage for s in out[0].samples] == [2.0, -2.0]
    out = assign_advantages(groups, "rloo")
    assert [s.advantage for s in out[0].samples] == [4.0, -4.0]


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_stacked_groups_equal_one_group_at_a_time(name):
    g = torch.Generator().manual_seed(0)
    rewards_N_G = torch.rand(5, 6, generator=g, dtype=torch.float64)
    rewards_N_G[1, 2] = float("nan")
    rewards_N_G[3, :5] = float("nan")  # one valid sample: zeros
    rewards_N_G[4] = 0.5  # no variance: zeros
    fn = ADVANTAGES[name]
    stacked = fn(rewards_N_G)
    for i in range(5):
        torch.testing.assert_close(stacked[i], fn(rewards_N_G[i]), atol=1e-12, rtol=0)
    assert bool((stacked[3] == 0).all()) and bool((stacked[4] == 0).all()) and stacked[1, 2] == 0


def test_reinforce_pp_normalises_over_the_batch_by_hand():
    from tokenmill.algorithms import reinforce_pp_advantages

    rewards = t([[1, 0, 0, 1], [1, 1, 1, 0]])
    # group means 0.5 and 0.75 -> centred [[.5, -.5, -.5, .5], [.25, .25, .25, -.75]]; batch mean 0;
    # unbiased batch std = sqrt((4 * .25 + 3 * .0625 + .5625) / 7) = sqrt(0.25) = 0.5
    adv = reinforce_pp_advantages(rewards)
    expected = t([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]) / (0.5 + 1e-4)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    # a group with a small spread is not blown up as per-group std scaling would: [1, 1, 1, 0.9]
    rewards = t([[1, 0, 0, 1], [1, 1, 1, 0.9]])
    assert abs(reinforce_pp_advantages(rewards)[1, 3].item()) < 0.2 < abs(grpo_advantages(rewards)[1, 3].item())


def test_assign_advantages_pads_groups_of_different_sizes():
    def group(i, rewards):
        return Group(i, tuple(Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0), prompt_len=1,
                                     prompt="p", completion="c", stop_reason=StopReason.STOP, reward=r)
                              for r in rewards))

    out = assign_advantages([group(0, [1.0, 0.0]), group(1, [1.0, 0.0, 0.0, 1.0])], "grpo")
    # [1, 0]: centred +-0.5, unbiased std sqrt(0.5); the padding of the shorter group changes nothing
    assert [s.advantage for s in out[0].samples] == pytest.approx([0.5 / (0.5**0.5 + 1e-4), -0.5 / (0.5**0.5 + 1e-4)])
    assert len(out[1].samples) == 4
    assert [s.advantage for s in out[1].samples] == pytest.approx(
        [a / (((4 * 0.25) / 3) ** 0.5 + 1e-4) for a in (0.5, -0.5, -0.5, 0.5)])
