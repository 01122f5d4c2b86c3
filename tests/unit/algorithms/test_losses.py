"""Policy losses, KL estimators and aggregation weights against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.algorithms import LOSSES, kl_penalty, ppo_clip_loss, sft_loss, token_weights

F64 = torch.float64

# Two sequences, four positions; position 0 is a prompt token (weight 0, ratio 1).
# Row 0 has advantage +1, row 1 advantage -2; ratios chosen inside (1.1), above (1.5) and below (0.5)
# the clip range [0.8, 1.2].
RATIOS = [[1.0, 1.1, 1.5, 0.5], [1.0, 1.1, 1.5, 0.5]]
OLD = [[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -1.7, -2.5]]
ADV = [1.0, -2.0]
WEIGHTS = [[0.0, 0.1, 0.2, 0.1], [0.0, 0.2, 0.3, 0.1]]
# per-token loss -min(r*A, clip(r)*A):
#   A=+1: r=1.1 -> -1.1 (inside); r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped); r=0.5 -> -min(0.5, 0.8) = -0.5 (not)
#   A=-2: r=1.1 -> 2.2 (inside);  r=1.5 -> -min(-3.0, -2.4) = 3.0 (not);   r=0.5 -> -min(-1.0, -1.6) = 1.6 (clipped)
PER_TOKEN = [[0.0, -1.1, -1.2, -0.5], [0.0, 2.2, 3.0, 1.6]]
CLIPPED = [[False, False, True, False], [False, False, False, True]]


def _inputs():
    old = torch.tensor(OLD, dtype=F64)
    logprobs = (old + torch.log(torch.tensor(RATIOS, dtype=F64))).requires_grad_(True)
    return logprobs, old, torch.tensor(ADV, dtype=F64), torch.tensor(WEIGHTS, dtype=F64)


def test_ppo_clip_loss_value_and_metrics():
    logprobs, old, adv, w = _inputs()
    loss, metrics = ppo_clip_loss(logprobs, old, adv, w, clip_low=0.2, clip_high=0.2)
    expected = sum(WEIGHTS[b][t] * PER_TOKEN[b][t] for b in range(2) for t in range(4))
    # 0.1*-1.1 + 0.2*-1.2 + 0.1*-0.5 + 0.2*2.2 + 0.3*3.0 + 0.1*1.6 = 1.1
    assert expected == pytest.approx(1.1)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["policy_loss"].item() == pytest.approx(expected, abs=1e-12)
    # clip fraction: weight on the clipped tokens, (0, 2) and (1, 3)
    assert metrics["clip_fraction"].item() == pytest.approx(0.2 + 0.1, abs=1e-12)
    ratio_mean = sum(WEIGHTS[b][t] * RATIOS[b][t] for b in range(2) for t in range(4))
    assert metrics["ratio_mean"].item() == pytest.approx(ratio_mean, abs=1e-12)
    assert "kl" not in metrics


def test_ppo_clip_gradient_matches_hand_formula():
    logprobs, old, adv, w = _inputs()
    loss, _ = ppo_clip_loss(logprobs, old, adv, w, clip_low=0.2, clip_high=0.2)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) * w = -A * ratio * w where the unclipped branch is taken, else 0
    expected = [
        [0.0 if CLIPPED[b][t] else -ADV[b] * RATIOS[b][t] * WEIGHTS[b][t] for t in range(4)] for b in range(2)
    ]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    # spelled out for one unclipped and one clipped token of each sign
    assert logprobs.grad[0, 3].item() == pytest.approx(-1.0 * 0.5 * 0.1)
    assert logprobs.grad[1, 2].item() == pytest.approx(2.0 * 1.5 * 0.3)
    assert logprobs.grad[0, 2].item() == 0.0 and logprobs.grad[1, 3].item() == 0.0


def test_ppo_clip_asymmetric_range():
    # clip_high 0.6 (DAPO's clip-higher): r=1.5 with A=+1 is now inside [0.8, 1.6]: loss -1.5, gradient flows
    logprobs, old, adv, w = _inputs()
    loss, metrics = ppo_clip_loss(logprobs, old, adv, w, clip_low=0.2, clip_high=0.6)
    expected = 1.1 + 0.2 * (-1.5 - -1.2)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["clip_fraction"].item() == pytest.approx(0.1, abs=1e-12)  # only (1, 3) still clipped
    loss.backward()
    assert logprobs.grad[0, 2].item() == pytest.approx(-1.0 * 1.5 * 0.2)


def test_ppo_clip_on_policy_gradient_is_minus_advantage_times_weight():
    # ratio 1 everywhere (first step on fresh samples): loss = -sum(w * A), grad = -A * w
    old = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64)
    logprobs = old.clone().requires_grad_(True)
    w = torch.tensor([[0.25, 0.25, 0.5]], dtype=F64)
    loss, metrics = ppo_clip_loss(logprobs, old, torch.tensor([0.8], dtype=F64), w)
    assert loss.item() == pytest.approx(-0.8)
    assert metrics["clip_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -0.8 * w, rtol=0, atol=1e-12)


def test_kl_penalty_k1_and_k3_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=F64)
    # k1 = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0, 0.0]], dtype=F64))
    # k3 = exp(r) - r - 1 with r = ref - logp = (-0.5, 1.0, 0.0)
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.e - 2.0, 0.0]
    assert k3[0] == pytest.approx(0.1065307, abs=1e-7) and k3[1] == pytest.approx(0.7182818, abs=1e-7)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([k3], dtype=F64), rtol=0, atol=1e-12)
    assert (kl_penalty(torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64), "k3") >= 0).all()


def test_kl_k3_clamps_the_log_ratio():
    # r = 50 would give exp(50); it is clamped to 20 first
    out = kl_penalty(torch.tensor([-60.0], dtype=F64), torch.tensor([-10.0], dtype=F64), "k3")
    assert out.item() == pytest.approx(math.exp(20.0) - 21.0)
    with pytest.raises(ValueError, match="k2"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k2")


def test_kl_k3_gradient():
    # d k3 / d logp = -exp(r) + 1 with r = ref - logp
    logp = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=F64)
    kl_penalty(logp, ref, "k3").sum().backward()
    expected = [1 - math.exp(-0.5), 1 - math.e]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_coef_adds_weighted_kl_to_the_loss(estimator):
    logprobs, old, adv, w = _inputs()
    ref = old - 0.3  # any reference
    base, _ = ppo_clip_loss(logprobs, old, adv, w)
    kl_B_T = kl_penalty(logprobs.detach(), ref, estimator)
    kl = (kl_B_T * w).sum().item()
    with_ref, metrics = ppo_clip_loss(logprobs, old, adv, w, ref_logprobs_B_T=ref, kl_coef=0.0,
                                      kl_estimator=estimator)
    assert with_ref.item() == pytest.approx(base.item(), abs=1e-12)  # kl_coef 0: reported, not added
    assert metrics["kl"].item() == pytest.approx(kl, abs=1e-12)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, w, ref_logprobs_B_T=ref, kl_coef=0.5,
                                  kl_estimator=estimator)
    assert loss.item() == pytest.approx(base.item() + 0.5 * kl, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(kl, abs=1e-12)
    assert metrics["policy_loss"].item() == pytest.approx(base.item(), abs=1e-12)


def test_sft_loss_and_gradient():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-3.0, -0.1, 0.0]], dtype=F64, requires_grad=True)
    w = torch.tensor([[0.0, 0.25, 0.25], [0.0, 0.5, 0.0]], dtype=F64)
    loss, metrics = sft_loss(logprobs, w)
    assert loss.item() == pytest.approx(0.25 * 1.0 + 0.25 * 2.0 + 0.5 * 0.1)
    assert metrics["nll"].item() == pytest.approx(loss.item())
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -w, rtol=0, atol=0)
    assert LOSSES["sft"] is sft_loss and LOSSES["ppo_clip"] is ppo_clip_loss


def test_token_weights_token_mean():
    trained = [3, 1, 4]
    w = token_weights(trained, "token_mean")
    assert w == [1 / 8] * 3
    assert sum(wi * n for wi, n in zip(w, trained)) == pytest.approx(1.0)


def test_token_weights_sequence_mean():
    trained = [2, 4, 5]
    w = token_weights(trained, "sequence_mean")
    assert w == pytest.approx([1 / 6, 1 / 12, 1 / 15])
    # each sequence contributes 1/3 in total
    assert [wi * n for wi, n in zip(w, trained)] == pytest.approx([1 / 3] * 3)
    assert token_weights([0, 2], "sequence_mean") == [0.0, 0.25]


def test_token_weights_token_sum_norm():
    trained = [2, 3]
    w = token_weights(trained, "token_sum_norm", max_tokens=5)
    assert w == [1 / 10, 1 / 10]
    # a constant: sums to 1 only when every sequence uses all max_tokens
    assert sum(wi * n for wi, n in zip(w, trained)) == pytest.approx(0.5)
    assert sum(wi * 5 for wi in w) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        token_weights(trained, "token_sum_norm")


def test_token_weights_edge_cases():
    assert token_weights([], "token_mean") == []
    assert token_weights([0, 0], "token_mean") == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown"):
        token_weights([1], "mean")  # type: ignore[arg-type]


# ------------------------------------------------------------------- GSPO and CISPO, on one short sequence
# position 0 is the prompt; trained tokens t=1, 2 with logp = -1.0, -2.0 and old logp = -1.2, -1.9,
# so the token log-ratios are +0.2 and -0.1.
def _one_sequence(advantage: float):
    logprobs = torch.tensor([[0.0, -1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, -1.2, -1.9]], dtype=F64)
    return logprobs, old, torch.tensor([advantage], dtype=F64), torch.tensor([[0.0, 0.5, 0.5]], dtype=F64)


def test_gspo_uses_the_sequence_ratio():
    from tokenmill.algorithms import gspo_loss

    logprobs, old, adv, w = _one_sequence(1.0)
    # s = exp((0.2 - 0.1) / 2) = exp(0.05) = 1.051271; inside [0.8, 1.2]: loss = -s, each token's grad = -s/2
    loss, metrics = gspo_loss(logprobs, old, adv, w, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-math.exp(0.05), abs=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(math.exp(0.05), abs=1e-12)
    assert metrics["clip_fraction"].item() == 0.0
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -math.exp(0.05) / 2, -math.exp(0.05) / 2], abs=1e-12)
    # a clip range of 1% clips s = 1.051 for a positive advantage: loss -1.01, no gradient
    logprobs, old, adv, w = _one_sequence(1.0)
    loss, metrics = gspo_loss(logprobs, old, adv, w, clip_low=0.01, clip_high=0.01)
    assert loss.item() == pytest.approx(-1.01, abs=1e-12)
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)
    loss.backward()
    assert logprobs.grad.abs().sum().item() == 0.0


def test_cispo_clips_the_weight_not_the_gradient():
    from tokenmill.algorithms import cispo_loss

    logprobs, old, adv, w = _one_sequence(2.0)
    # ratios e^0.2 = 1.2214 (clipped to 1.1) and e^-0.1 = 0.9048 (kept); A = 2
    # loss = -(0.5 * 1.1 * 2 * -1.0 + 0.5 * 0.9048 * 2 * -2.0) = 1.1 + 1.8097 = 2.9097
    loss, metrics = cispo_loss(logprobs, old, adv, w, clip_low=0.1, clip_high=0.1)
    assert loss.item() == pytest.approx(1.1 + 2 * math.exp(-0.1), abs=1e-12)
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    # d loss / d logp_t = -0.5 * weight_t * A: the clipped token still has a gradient (PPO-clip's would be 0)
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.1, -math.exp(-0.1)], abs=1e-12)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_new_losses_add_the_kl_term(name):
    logprobs, old, adv, w = _one_sequence(1.0)
    ref = torch.tensor([[0.0, -1.1, -2.1]], dtype=F64)
    base, _ = LOSSES[name](logprobs, old, adv, w)
    with_kl, metrics = LOSSES[name](logprobs, old, adv, w, ref_logprobs_B_T=ref, kl_coef=0.5, kl_estimator="k1")
    # k1 = logp - ref = +0.1 at both tokens; weighted 0.5 + 0.5 -> KL metric 0.1, loss + 0.5 * 0.1
    assert metrics["kl"].item() == pytest.approx(0.1, abs=1e-12)
    assert with_kl.item() == pytest.approx(base.item() + 0.05, abs=1e-12)
