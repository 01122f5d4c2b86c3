"""Off-policy corrections (truncated IS, decoupled PPO) against hand-computed numbers, and their plumbing
through `policy_update` on a tiny real model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenmill.algorithms.losses import behaviour_weights, off_policy_loss, ppo_clip_loss
from tokenmill.config import AlgorithmConfig
from tokenmill.training import LocalBackend, collate
from tokenmill.training.update import policy_update, with_trainer_logprobs
from tokenmill.types import Sample, StopReason

F64 = torch.float64
# One sequence, position 0 a prompt token. Per trained token: current pi, proximal (trainer before the
# update) pi, behaviour (sampler) pi:
#   t1: 0.5 / 0.4 / 0.2  -> r = 1.25 (clipped at 1.2: no gradient), w = 2
#   t2: 0.3 / 0.3 / 0.6  -> r = 1.0,  w = 0.5
#   t3: 0.1 / 0.2 / 0.05 -> r = 0.5 (below 0.8, A > 0: the unclipped branch is the min), w = 4
CURRENT = [1.0, 0.5, 0.3, 0.1]
PROX = [1.0, 0.4, 0.3, 0.2]
BEHAVIOUR = [1.0, 0.2, 0.6, 0.05]
WEIGHTS = [0.0, 0.5, 0.25, 0.25]
PPO = [0.0, -1.2, -1.0, -0.5]  # -min(r A, clip(r) A) with A = +1


def _inputs():
    log = lambda xs: torch.log(torch.tensor([xs], dtype=F64))
    logprobs = log(CURRENT).requires_grad_(True)
    return logprobs, log(PROX), log(BEHAVIOUR), torch.tensor([1.0], dtype=F64), torch.tensor([WEIGHTS], dtype=F64)


def test_behaviour_weights_truncate_or_drop():
    _, prox, behaviour, _, _ = _inputs()
    tis, raw = behaviour_weights(prox, behaviour, "tis", cap=3.0)
    torch.testing.assert_close(raw, torch.tensor([[1.0, 2.0, 0.5, 4.0]], dtype=F64))
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.5, 3.0]], dtype=F64))
    dec, _ = behaviour_weights(prox, behaviour, "decoupled", cap=3.0)
    torch.testing.assert_close(dec, torch.tensor([[1.0, 2.0, 0.5, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="unknown off-policy"):
        behaviour_weights(prox, behaviour, "vtrace", cap=3.0)


def test_masked_and_sequence_weights():
    _, prox, behaviour, _, w = _inputs()
    mask = w > 0  # the sequence ratio is over the trained tokens: W = 2 * 0.5 * 4 = 4
    mis, raw = behaviour_weights(prox, behaviour, "mis", cap=3.0)  # kept: 1/3 <= w <= 3
    torch.testing.assert_close(mis, torch.tensor([[1.0, 2.0, 0.5, 0.0]], dtype=F64))
    mis, _ = behaviour_weights(prox, behaviour, "mis", cap=1.9)  # 0.5 is now below 1/1.9, 2 above 1.9
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64))
    seq, raw = behaviour_weights(prox, behaviour, "seq_tis", cap=3.0, mask_B_T=mask)
    torch.testing.assert_close(raw, torch.full((1, 4), 4.0, dtype=F64))
    torch.testing.assert_close(seq, torch.full((1, 4), 3.0, dtype=F64))
    seq, _ = behaviour_weights(prox, behaviour, "seq_mis", cap=3.0, mask_B_T=mask)
    torch.testing.assert_close(seq, torch.zeros((1, 4), dtype=F64))
    seq, _ = behaviour_weights(prox, behaviour, "seq_mis", cap=5.0, mask_B_T=mask)
    torch.testing.assert_close(seq, torch.full((1, 4), 4.0, dtype=F64))
    # two rows: each its own sequence ratio
    two, _ = behaviour_weights(torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.9]], dtype=F64)),
                               torch.log(torch.tensor([[0.25, 0.5], [0.4, 0.9]], dtype=F64)), "seq_tis", cap=10.0)
    torch.testing.assert_close(two, torch.tensor([[2.0, 2.0], [0.5, 0.5]], dtype=F64))


@pytest.mark.parametrize("mode, cap, c, expected", [
    # sum_t weights_t * c_t * ppo_t: 0.5*2*-1.2 + 0.25*0.5*-1.0 + 0.25*c3*-0.5
    ("tis", 3.0, [0.0, 2.0, 0.5, 3.0], -1.2 - 0.125 - 0.375),
    ("decoupled", 3.0, [0.0, 2.0, 0.5, 0.0], -1.2 - 0.125),
    ("mis", 3.0, [0.0, 2.0, 0.5, 0.0], -1.2 - 0.125),
    # the sequence ratio W = 4: capped at 3 on every token (3 * -0.975), or kept whole under a cap of 5
    ("seq_tis", 3.0, [0.0, 3.0, 3.0, 3.0], -2.925),
    ("seq_mis", 5.0, [0.0, 4.0, 4.0, 4.0], -3.9),
])
def test_off_policy_loss_value_gradient_and_metrics(mode, cap, c, expected):
    logprobs, prox, behaviour, adv, w = _inputs()
    loss, metrics = off_policy_loss(ppo_clip_loss, mode, logprobs, old_logprobs_B_T=prox,
                                    behaviour_logprobs_B_T=behaviour, weights_B_T=w, is_cap=cap, advantages=adv,
                                    clip_low=0.2, clip_high=0.2)
    assert sum(WEIGHTS[t] * c[t] * PPO[t] for t in range(4)) == pytest.approx(expected)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    # d/dlogp of -A r w c on the unclipped branch = -A r w c; the clipped t1 has none
    ratios = [p / q for p, q in zip(CURRENT, PROX, strict=True)]
    grad = [0.0, 0.0, -ratios[2] * WEIGHTS[2] * c[2], -ratios[3] * WEIGHTS[3] * c[3]]
    torch.testing.assert_close(logprobs.grad, torch.tensor([grad], dtype=F64), rtol=0, atol=1e-12)
    if mode.startswith("seq"):
        assert metrics["is_weight_mean"].item() == pytest.approx(4.0)
        assert metrics["is_capped_fraction"].item() == pytest.approx(1.0 if mode == "seq_tis" else 0.0)
    else:
        assert metrics["is_weight_mean"].item() == pytest.approx(0.5 * 2 + 0.25 * 0.5 + 0.25 * 4)
        assert metrics["is_capped_fraction"].item() == pytest.approx(0.25)


def test_fresh_samples_make_the_correction_a_no_op():
    logprobs, prox, _, adv, w = _inputs()
    plain, _ = ppo_clip_loss(logprobs, prox, adv, w)
    for mode in ("tis", "mis", "seq_tis", "seq_mis", "decoupled"):
        corrected, m = off_policy_loss(ppo_clip_loss, mode, logprobs, old_logprobs_B_T=prox,
                                       behaviour_logprobs_B_T=prox.clone(), weights_B_T=w, advantages=adv)
        assert corrected.item() == pytest.approx(plain.item(), abs=1e-12)
        assert m["is_weight_mean"].item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------------ through policy_update
def _samples(n=6, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randint(3, 60) for _ in range(3)]
        completion = [rng.randint(3, 60) for _ in range(4)]
        out.append(Sample(
            tokens=tuple(prompt + completion), loss_mask=(0,) * 3 + (1,) * 4, logprobs=(0.0,) * 7, prompt_len=3,
            prompt="p", completion="c", stop_reason=StopReason.STOP, advantage=1.0 if i % 2 else -1.0,
        ))
    return out


def _grad_norm(model_path, samples, **algo):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, max_grad_norm=1e9)
    out = policy_update(samples, backend, AlgorithmConfig(**algo), pad_id=0, max_tokens=4, rng=random.Random(0))
    return out["grad_norm"], out


def test_policy_update_recomputes_the_proximal_policy_and_weighs_tokens(tiny_model_path, tiny_model):
    backend = LocalBackend(tiny_model, learning_rate=1e-3, total_steps=1)
    exact, behaviour = with_trainer_logprobs(_samples(), backend, pad_id=0)
    # the recomputed logprobs are the model's own (prompt positions stay 0) and the sampler's are kept aside
    assert all(s.logprobs[:3] == (0.0,) * 3 and all(lp < 0 for lp in s.logprobs[3:]) for s in exact)
    assert all(behaviour[id(s)] == (0.0,) * 7 for s in exact)
    batch = collate(exact, [1.0] * 6, 0)
    again = float((backend.forward(batch) * (batch.weights_B_T > 0)).sum())
    assert again < -1.0 and abs(again - sum(sum(s.logprobs) for s in exact)) < 1e-4

    on_policy, _ = _grad_norm(tiny_model_path, exact)
    # fresh samples: tis is a no-op
    tis, m = _grad_norm(tiny_model_path, exact, off_policy="tis", is_cap=3.0)
    assert tis == pytest.approx(on_policy, rel=1e-4) and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # a sampler that gave every token half the trainer's probability: w = 2 on every token, so the loss (and its
    # gradient) doubles with tis (cap 3); decoupled with cap 1.5 drops every token: no gradient at all
    stale = [s.with_(logprobs=tuple(lp - math.log(2) if m else 0.0 for lp, m in zip(s.logprobs, s.loss_mask,
                                                                                   strict=True))) for s in exact]
    doubled, m = _grad_norm(tiny_model_path, stale, off_policy="tis", is_cap=3.0)
    assert doubled == pytest.approx(2 * on_policy, rel=1e-3)
    assert m["is_weight_mean"] == pytest.approx(2.0, rel=1e-4) and m["is_capped_fraction"] == 0.0
    dropped, m = _grad_norm(tiny_model_path, stale, off_policy="decoupled", is_cap=1.5)
    assert dropped == 0.0 and m["is_capped_fraction"] == pytest.approx(1.0)
    # without a correction the stale sampler logprobs are the PPO anchor: ratio 2 is clipped, no gradient on A>0
    naive, m = _grad_norm(tiny_model_path, stale)
    assert m["clip_fraction"] > 0.4 and naive != pytest.approx(on_policy, rel=1e-2)


# ------------------------------------------------------------------------------------ masks: ratio band, binary KL
def test_binary_kl_by_hand():
    from tokenmill.algorithms.losses import binary_kl

    _, prox, behaviour, _, _ = _inputs()
    # KL(Bern(p_behaviour) || Bern(p_prox)) = p ln(p/q) + (1-p) ln((1-p)/(1-q))
    by_hand = [0.0, 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6), 0.6 * math.log(2.0) + 0.4 * math.log(0.4 / 0.7),
               0.05 * math.log(0.25) + 0.95 * math.log(0.95 / 0.8)]
    torch.testing.assert_close(binary_kl(behaviour, prox), torch.tensor([by_hand], dtype=F64))
    assert by_hand[1] == pytest.approx(0.091516, abs=1e-6) and by_hand[2] == pytest.approx(0.192042, abs=1e-6)
    assert by_hand[3] == pytest.approx(0.093943, abs=1e-6)
    # a certain token under q but not under p is infinitely far; equal probabilities are 0 apart
    edge = binary_kl(torch.log(torch.tensor([0.5, 1.0], dtype=F64)), torch.log(torch.tensor([1.0, 1.0], dtype=F64)))
    assert edge[0].item() == math.inf and edge[1].item() == 0.0


def test_ratio_band_and_binary_kl_masks_match_by_hand():
    _, prox, behaviour, _, _ = _inputs()  # w = [1, 2, 0.5, 4]
    icepop, raw = behaviour_weights(prox, behaviour, "icepop", cap=2.0, ratio_band=(0.6, 3.0))
    torch.testing.assert_close(raw, torch.tensor([[1.0, 2.0, 0.5, 4.0]], dtype=F64))
    torch.testing.assert_close(icepop, torch.tensor([[1.0, 2.0, 0.0, 0.0]], dtype=F64))
    wide, _ = behaviour_weights(prox, behaviour, "icepop", cap=2.0, ratio_band=(0.4, 5.0))  # the cap plays no part
    torch.testing.assert_close(wide, raw)
    # binary KL per token: 0, 0.0915, 0.1920, 0.0939: a band of 0.1 keeps t3 (ratio 4, rare token) and drops t2
    # (ratio 0.5, a likely token that lost half its probability); the ratio band does the opposite
    kl, _ = behaviour_weights(prox, behaviour, "binary_kl", cap=2.0, kl_band=0.1)
    torch.testing.assert_close(kl, torch.tensor([[1.0, 2.0, 0.0, 4.0]], dtype=F64))
    kl, _ = behaviour_weights(prox, behaviour, "binary_kl", cap=2.0, kl_band=0.092)
    torch.testing.assert_close(kl, torch.tensor([[1.0, 2.0, 0.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("mode, band, c, masked", [
    ("icepop", {"ratio_band": (0.6, 3.0)}, [0.0, 2.0, 0.0, 0.0], 0.5),
    ("binary_kl", {"kl_band": 0.1}, [0.0, 2.0, 0.0, 4.0], 0.25),
])
def test_mask_loss_gradient_and_mask_fraction(mode, band, c, masked):
    logprobs, prox, behaviour, adv, w = _inputs()
    loss, metrics = off_policy_loss(ppo_clip_loss, mode, logprobs, old_logprobs_B_T=prox,
                                    behaviour_logprobs_B_T=behaviour, weights_B_T=w, advantages=adv, **band)
    assert loss.item() == pytest.approx(sum(WEIGHTS[t] * c[t] * PPO[t] for t in range(4)), abs=1e-12)
    loss.backward()
    ratios = [p / q for p, q in zip(CURRENT, PROX, strict=True)]
    grad = [0.0, 0.0, -ratios[2] * WEIGHTS[2] * c[2], -ratios[3] * WEIGHTS[3] * c[3]]
    torch.testing.assert_close(logprobs.grad, torch.tensor([grad], dtype=F64), rtol=0, atol=1e-12)
    # the share of the trained tokens' weight that was dropped (t2 weighs 0.25, t3 0.25)
    assert metrics["is_masked_fraction"].item() == pytest.approx(masked)
    assert metrics["is_capped_fraction"].item() == pytest.approx(masked)


def test_masks_through_policy_update(tiny_model_path, tiny_model):
    backend = LocalBackend(tiny_model, learning_rate=1e-3, total_steps=1)
    exact, _ = with_trainer_logprobs(_samples(), backend, pad_id=0)
    on_policy, m = _grad_norm(tiny_model_path, exact, off_policy="icepop")
    assert m["is_masked_fraction"] == 0.0
    # every token with w = 2: inside [0.5, 5] it doubles the gradient, above mask_high 1.5 it is dropped
    stale = [s.with_(logprobs=tuple(lp - math.log(2) if m else 0.0 for lp, m in zip(s.logprobs, s.loss_mask,
                                                                                   strict=True))) for s in exact]
    doubled, m = _grad_norm(tiny_model_path, stale, off_policy="icepop")
    assert doubled == pytest.approx(2 * on_policy, rel=1e-3) and m["is_masked_fraction"] == 0.0
    dropped, m = _grad_norm(tiny_model_path, stale, off_policy="icepop", mask_high=1.5)
    assert dropped == 0.0 and m["is_masked_fraction"] == pytest.approx(1.0)
    kept, m = _grad_norm(tiny_model_path, stale, off_policy="binary_kl", mask_kl=10.0)
    assert kept == pytest.approx(2 * on_policy, rel=1e-3) and m["is_masked_fraction"] == 0.0
    dropped, m = _grad_norm(tiny_model_path, stale, off_policy="binary_kl", mask_kl=1e-6)
    assert dropped == 0.0 and m["is_masked_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize("field, value", [("mask_low", 1.5), ("mask_low", 0.0), ("mask_high", 0.9), ("mask_kl", 0.0)])
def test_mask_bands_are_validated_by_field(field, value):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.types import ConfigError

    tree = {"model": {"path": "m"}, "data": {"task": "addition"}, "algorithm": {"off_policy": "icepop", field: value}}
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        load_config(RLConfig, tree)
