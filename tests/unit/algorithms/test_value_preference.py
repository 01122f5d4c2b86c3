"""GAE, the clipped value loss and the preference / reward-model losses against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.algorithms.preference import bradley_terry_loss, dpo_loss, ipo_loss, simpo_loss
from tokenmill.algorithms.value import gae, value_loss

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def test_gae_by_hand():
    rewards, values, mask = t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    # gamma = lam = 1: deltas 0.1, 0.1, 0.3 -> A = 0.5, 0.4, 0.3; returns = A + V = 1, 1, 1 (the final reward)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.4, 0.3])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    # gamma 0.9, lam 0.5: deltas 0.04, 0.03, 0.3 -> A2 = 0.3, A1 = 0.03 + 0.45 * 0.3 = 0.165,
    # A0 = 0.04 + 0.45 * 0.165 = 0.11425
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.11425, 0.165, 0.3])


def test_gae_skips_masked_tokens_and_padding():
    # prompt token, policy token, environment token, policy token (final reward 1), padding
    rewards, values = t([[0, 0, 0, 1, 0]]), t([[9.0, 0.6, 9.0, 0.7, 9.0]])
    mask = t([[0, 1, 0, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # the chain is the two policy tokens: A = [0.4, 0.3] as in a 2-token episode with V = 0.6, 0.7
    assert adv.tolist()[0] == pytest.approx([0.0, 0.4, 0.0, 0.3, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.0, 1.0, 0.0, 1.0, 0.0])


def test_value_loss_clipped_by_hand():
    old, ret, w = t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[0.5, 0.5]])
    values = t([[0.5, -0.5]]).requires_grad_(True)
    # token 0: V moved +0.5 toward R, clipped to +0.2 -> errors 0.25 vs 0.64 -> max 0.64 (clipped counts)
    # token 1: V moved -0.5 away from R -> errors 2.25 vs 1.44 -> max 2.25
    loss, metrics = value_loss(values, old, ret, w, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.5 * 0.64 + 0.5 * 2.25))
    assert metrics["vf_clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    # token 0 is on the clipped branch (no gradient); token 1: d/dV 0.5 * 0.5 * (V - R)^2 = 0.5 * (V - R) = -0.75
    assert values.grad.tolist()[0] == pytest.approx([0.0, -0.75])
    plain, _ = value_loss(t([[0.5, -0.5]]), old, ret, w, clip=None)
    assert plain.item() == pytest.approx(0.5 * (0.5 * 0.25 + 0.5 * 2.25))


def test_value_loss_inside_the_clip_range_keeps_every_gradient():
    # V moved by less than the clip, but V_old + (V - V_old) rounds away from V in float32: these three tokens
    # once took the clipped branch (no gradient) and counted as clipped
    f32 = torch.float32
    values = torch.tensor([[0.060491468757390976, -0.019204536452889442, -0.03802011162042618]], dtype=f32,
                          requires_grad=True)
    old = torch.tensor([[0.16738520562648773, -0.14795896410942078, -0.18436560034751892]], dtype=f32)
    ret = torch.tensor([[0.005919549614191055, 0.009060759097337723, -0.5595830082893372]], dtype=f32)
    w = torch.ones(1, 3)
    loss, metrics = value_loss(values, old, ret, w, clip=0.2)
    assert metrics["vf_clip_fraction"].item() == 0.0
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx((values - ret).detach().tolist()[0], rel=1e-6)


def test_dpo_ipo_simpo_bradley_terry_by_hand():
    chosen, rejected, ref_c, ref_r = t([-5.0]), t([-7.0]), t([-6.0]), t([-6.5])
    # h = (-5 + 6) - (-7 + 6.5) = 1.5
    loss, m = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.15)))
    assert m["accuracy"].item() == 1.0 and m["margin"].item() == pytest.approx(0.15)
    smooth, _ = dpo_loss(chosen, rejected, ref_c, ref_r, beta=0.1, label_smoothing=0.2)
    assert smooth.item() == pytest.approx(0.8 * math.log1p(math.exp(-0.15)) + 0.2 * math.log1p(math.exp(0.15)))
    loss, _ = ipo_loss(chosen, rejected, ref_c, ref_r, beta=0.1)
    assert loss.item() == pytest.approx((1.5 - 5.0) ** 2)
    # SimPO: -6 / 3 = -2 vs -8 / 2 = -4; beta 2, gamma 0.5 -> logits 3.5
    loss, m = simpo_loss(t([-6.0]), t([-8.0]), t([3.0]), t([2.0]), beta=2.0, gamma=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-3.5)))
    loss, m = bradley_terry_loss(t([1.0, -1.0]), t([-1.0, 1.0]))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-2.0)) + math.log1p(math.exp(2.0))) / 2)
    assert m["accuracy"].item() == 0.5


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = t([-5.0]).requires_grad_(True), t([-7.0]).requires_grad_(True)
    loss, _ = dpo_loss(chosen, rejected, t([-6.0]), t([-6.5]), beta=0.1)
    loss.backward()
    # d/d pi_c = -beta * sigmoid(-beta h) < 0 (descending raises pi_c); d/d pi_r is its negative
    g = -0.1 / (1 + math.exp(0.15))
    assert chosen.grad.item() == pytest.approx(g) and rejected.grad.item() == pytest.approx(-g)


def test_pair_logprobs_match_one_sequence_at_a_time(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from tokenmill.training.local import token_logprobs
    from tokenmill.training.preference import pair_logprobs
    from tokenmill.training.sft import sft_sample

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "12345"},
            {"prompt": "10+20=", "chosen": "30", "rejected": "4"}]
    with torch.no_grad():
        chosen, rejected, chosen_len, rejected_len = pair_logprobs(model, tokenizer, rows)

        def alone(prompt, completion):
            s = sft_sample(tokenizer, prompt, completion)
            ids = torch.tensor([s.tokens])
            lp = token_logprobs(model(input_ids=ids).logits, ids, 1.0)[0]
            return float((lp * torch.tensor(s.loss_mask, dtype=lp.dtype)).sum()), sum(s.loss_mask)

        for i, r in enumerate(rows):
            c, nc = alone(r["prompt"], r["chosen"])
            j, nj = alone(r["prompt"], r["rejected"])
            assert chosen[i].item() == pytest.approx(c, abs=1e-5) and chosen_len[i].item() == nc
            assert rejected[i].item() == pytest.approx(j, abs=1e-5) and rejected_len[i].item() == nj
