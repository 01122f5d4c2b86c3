"""PPO with a critic: per-token rewards, whitening, GAE over real samples, the critic's training, and the
policy loss with per-token advantages, against hand-computed numbers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenmill.algorithms.losses import ppo_clip_loss
from tokenmill.algorithms.value import explained_variance, token_rewards, whiten
from tokenmill.config import AlgorithmConfig, CriticConfig, RLConfig, load_config
from tokenmill.training.batch import collate
from tokenmill.training.critic import Critic, gae_advantages, load_critic
from tokenmill.training.local import ReferenceModel
from tokenmill.training.update import value_update
from tokenmill.types import ConfigError, Sample, StopReason


def sample(prompt: list[int], completion: list[int], reward: float, logprob: float = -1.0) -> Sample:
    n_p, n_c = len(prompt), len(completion)
    return Sample(
        tokens=tuple(prompt + completion), loss_mask=(0,) * n_p + (1,) * n_c,
        logprobs=(0.0,) * n_p + (logprob,) * n_c, prompt_len=n_p, prompt="p", completion="c",
        stop_reason=StopReason.STOP, reward=reward,
    )


def test_token_rewards_by_hand():
    # prompt, prompt, 3 policy tokens, padding; score 2 on the last policy token; KL-in-reward with coef 0.1
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    logp = torch.tensor([[0.0, 0.0, -1.0, -2.0, -0.5, 0.0]])
    ref = torch.tensor([[0.0, 0.0, -1.5, -1.0, -0.5, 0.0]])
    r = token_rewards(torch.tensor([2.0]), mask, logp, ref, kl_coef=0.1)
    # -0.1 * (logp - ref) = -0.05, +0.1, 0 on the policy tokens; + 2 on the last one
    assert r.tolist()[0] == pytest.approx([0.0, 0.0, -0.05, 0.1, 2.0, 0.0])
    # a row without policy tokens gets no reward at all (nothing to credit it to)
    empty = token_rewards(torch.tensor([5.0]), torch.zeros(1, 3), kl_coef=0.0)
    assert empty.tolist() == [[0.0, 0.0, 0.0]]


def test_whiten_and_explained_variance_by_hand():
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0]])
    mask = torch.tensor([[0, 1, 1, 1]])
    # mean 2, variance 2/3 over the masked tokens: (x - 2) / sqrt(2/3)
    s = math.sqrt(2 / 3)
    assert whiten(x, mask).tolist()[0] == pytest.approx([0.0, -1 / s, 0.0, 1 / s], abs=1e-6)
    ret = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    # a constant guess explains nothing; V = R - 1 on one token: Var[R - V] = 2/9, Var[R] = 2/3 -> 1 - 1/3
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[0.0, 0.0, 2.0, 3.0]]), ret, mask) == pytest.approx(2 / 3)


@pytest.fixture
def critic(tiny_model_path):
    torch.manual_seed(0)
    model = load_critic(CriticConfig(), tiny_model_path, torch.device("cpu"))
    return Critic(model, learning_rate=3e-3, total_steps=100, value_clip=None, micro_batch_tokens=64)


def test_fresh_critic_has_zero_values_so_gae_is_discounted_reward(critic):
    samples = [sample([5, 6, 7], [8, 9, 10], reward=1.0), sample([5, 6], [11, 12], reward=-2.0)]
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=0.5, whiten_advantages=False)
    out, metrics = gae_advantages(samples, critic, algo, pad_id=0)
    # V = 0 everywhere, reward on the last token: A_t = lam^(steps to the end) x R, returns = A
    assert out[0].token_advantages == pytest.approx((0, 0, 0, 0.25, 0.5, 1.0))
    assert out[0].returns == pytest.approx((0, 0, 0, 0.25, 0.5, 1.0))
    assert out[1].token_advantages == pytest.approx((0, 0, -1.0, -2.0))
    assert out[0].values == (0.0,) * 6
    assert metrics["critic/value_mean"] == 0.0
    assert metrics["critic/return_mean"] == pytest.approx((0.25 + 0.5 + 1.0 - 1.0 - 2.0) / 5)
    # whitened: the five policy tokens have mean 0 and std 1
    out, _ = gae_advantages(samples, critic, algo.model_copy(update={"whiten_advantages": True}), pad_id=0)
    adv = [a for s in out for a, m in zip(s.token_advantages, s.loss_mask, strict=True) if m]
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)
    assert sum(a * a for a in adv) / len(adv) == pytest.approx(1.0, abs=1e-5)


def test_kl_in_reward_uses_the_reference(critic, tiny_model_path, tiny_model):
    samples = [sample([5, 6, 7], [8, 9], reward=1.0, logprob=-0.5)]
    ref = ReferenceModel(tiny_model, temperature=1.0, token_budget=64, share_prompts=False)
    ref_lp = ref.forward(collate(samples, [1.0], 0))[0].tolist()
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=False, kl_coef=0.2,
                           kl_in_reward=True)
    out, metrics = gae_advantages(samples, critic, algo, pad_id=0, reference=ref)
    kl = [-0.5 - ref_lp[3], -0.5 - ref_lp[4]]
    # lam = gamma = 1 and V = 0: A_t is the sum of the rewards from t on
    assert out[0].token_advantages[3:] == pytest.approx((-0.2 * kl[0] - 0.2 * kl[1] + 1.0, -0.2 * kl[1] + 1.0))
    assert metrics["kl"] == pytest.approx(sum(kl) / 2)


def test_critic_learns_the_returns(critic):
    # two prompts, always rewarded 1 and 0: the critic must learn to tell them apart
    samples = [sample([5, 6, 7], [8, 9], reward=1.0), sample([7, 6, 5], [8, 9], reward=0.0)] * 4
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, mini_batches=2)
    first = None
    for _ in range(40):
        with_adv, _ = gae_advantages(samples, critic, algo, pad_id=0)
        metrics = value_update(with_adv, critic, algo, pad_id=0, rng=random.Random(0))
        first = first if first is not None else metrics["critic/value_loss"]
    out, metrics = gae_advantages(samples, critic, algo, pad_id=0)
    assert metrics["critic/explained_variance"] > 0.9
    assert metrics["critic/value_mean"] == pytest.approx(0.5, abs=0.1)
    assert out[0].values[-1] == pytest.approx(1.0, abs=0.15) and out[1].values[-1] == pytest.approx(0.0, abs=0.15)
    assert first > 0.1  # it started far off (zero head, returns of 1 for half the tokens)


def test_ppo_clip_with_per_token_advantages_by_hand():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.0, 2.0, -1.0]])
    w = torch.tensor([[0.0, 0.5, 0.5]])
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, w)
    # ratio 1: loss = -sum(w * A) = -(0.5 * 2 - 0.5 * 1) = -0.5, and d loss / d logp_t = -w_t A_t
    assert float(loss.detach()) == pytest.approx(-0.5)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.5])
    # per-sequence advantages still broadcast
    loss_seq, _ = ppo_clip_loss(logp.detach(), logp.detach(), torch.tensor([2.0]), w)
    assert float(loss_seq) == pytest.approx(-2.0)


def test_ppo_config_checks():
    base = {"model": {"path": "m"}, "data": {"task": "addition"}}
    cfg = load_config(RLConfig, base, {"algorithm.advantage": "gae", "critic.warmup_steps": 3})
    assert cfg.critic.warmup_steps == 3 and cfg.critic.path is None
    with pytest.raises(ConfigError, match="^algorithm.loss: 'gspo'"):
        load_config(RLConfig, base, {"algorithm.advantage": "gae", "algorithm.loss": "gspo"})
    with pytest.raises(ConfigError, match="^algorithm.kl_in_reward: only PPO"):
        load_config(RLConfig, base, {"algorithm.kl_in_reward": True})
    with pytest.raises(ConfigError, match="critic.value_clip"):
        load_config(RLConfig, base, {"critic.value_clip": -1})


def test_the_critic_has_no_dropout_so_its_values_do_not_depend_on_train_mode(tiny_model_path):
    model = load_critic(CriticConfig(), tiny_model_path, torch.device("cpu"))
    with torch.no_grad():
        model.score.weight.normal_()  # a trained head: non-zero values
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    values = [model.train()(ids).logits for _ in range(2)] + [model.eval()(ids).logits]
    assert values[0].abs().max() > 0
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)
    torch.testing.assert_close(values[0], values[2], rtol=0, atol=0)


def test_missing_critic_folder_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="^critic.path: cannot load a value model"):
        load_critic(CriticConfig(path=str(tmp_path / "nope")), "unused", torch.device("cpu"))


def test_critic_packs_shared_prompts_with_the_values_and_gradients_of_padded_rows(tiny_model_path):
    """Groups sharing a prompt run it once (token budget counts the packed rows); the values of every trained
    token and the value-loss gradients are those of one padded row per sequence."""
    rng = random.Random(0)
    samples = []
    for prompt_len, count in ((3, 4), (5, 3)):
        prompt = [rng.randint(3, 20) for _ in range(prompt_len)]
        for _ in range(count):
            samples.append(sample(prompt, [rng.randint(3, 20) for _ in range(rng.randint(1, 5))], reward=rng.random()))
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=0.9, whiten_advantages=False)
    runs = {}
    for share in (False, True):
        torch.manual_seed(0)
        model = load_critic(CriticConfig(), tiny_model_path, torch.device("cpu"))
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.5)
        model.dropout.p = 0.0  # the head's dropout (0.1) would draw different masks for different shapes
        critic = Critic(model, learning_rate=1e-3, total_steps=1, value_clip=0.2, micro_batch_tokens=20,
                        share_prompts=share)
        with_adv, _ = gae_advantages(samples, critic, algo, pad_id=0)
        batch = collate(with_adv, [1.0] * len(with_adv), 0)
        batch = batch.__class__(**{**batch.__dict__, "old_values_B_T": batch.old_values_B_T + 0.3})  # clip bites
        metrics = critic.forward_backward(batch)
        runs[share] = with_adv, metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (adv0, m0, g0), (adv1, m1, g1) = runs[False], runs[True]
    for a, b in zip(adv0, adv1, strict=True):
        trained = [i for i, m in enumerate(a.loss_mask) if m]
        assert [b.values[i] for i in trained] == pytest.approx([a.values[i] for i in trained], abs=1e-5)
        assert b.token_advantages == pytest.approx(a.token_advantages, abs=1e-5)
    assert any(abs(v) > 0.05 for s in adv0 for v in s.values)
    # relative: a loss of 152 is 1.5e-5 apart from its fp32 neighbours (3.8e-6 apart on an AVX-512 CPU)
    assert m1["value_loss"] == pytest.approx(m0["value_loss"], rel=1e-6) and m0["value_loss"] > 1e-3
    for name, g in g0.items():
        torch.testing.assert_close(g1[name], g, atol=1e-5, rtol=1e-4, msg=name)
