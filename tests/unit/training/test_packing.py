"""Shared-prompt packing gives the same logprobs, losses and gradients as one padded row per sequence."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.algorithms import token_weights
from tokenmill.config import AlgorithmConfig
from tokenmill.training import LocalBackend, collate, token_logprobs
from tokenmill.training.packing import micro_packs, plan_rows, shares_prompts
from tokenmill.training.update import _batch_loss
from tokenmill.types import Sample, StopReason


def _groups(vocab: int, seed: int = 0) -> list[Sample]:
    """Three prompts (2, 4 and 5 tokens) with 4, 3 and 2 completions of 1-6 tokens; random advantages."""
    rng = random.Random(seed)
    out = []
    for prompt_len, count in ((2, 4), (4, 3), (5, 2)):
        prompt = [rng.randint(3, vocab - 1) for _ in range(prompt_len)]
        for _ in range(count):
            completion = [rng.randint(3, vocab - 1) for _ in range(rng.randint(1, 6))]
            tokens = prompt + completion
            out.append(Sample(
                tokens=tuple(tokens), loss_mask=(0,) * prompt_len + (1,) * len(completion),
                logprobs=(0.0,) * prompt_len + tuple(-rng.uniform(1.0, 4.0) for _ in completion),
                prompt_len=prompt_len, prompt="p", completion="c", stop_reason=StopReason.STOP,
                advantage=rng.uniform(-1.5, 1.5),
            ))
    return out


def _run(model_path, samples, *, share: bool, budget: int = 10_000):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=budget, share_prompts=share)
    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    batch = collate(samples, weights, pad_id=0)
    metrics = backend.forward_backward(batch, _batch_loss("ppo_clip", AlgorithmConfig()))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, metrics, batch


def test_plan_puts_each_prompt_once_per_row(tokenizer):
    samples = _groups(len(tokenizer))
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    assert shares_prompts(batch)
    rows = plan_rows(batch, 10_000)
    assert sorted(len(p) for p, _ in rows) == [2, 4, 5]
    assert sorted(len(m) for _, m in rows) == [2, 3, 4]
    # 9 sequences of 3..11 tokens packed into 3 rows: every prompt token is computed once
    packed_tokens = sum(len(p) + sum(int(batch.lengths_B[b]) - len(p) for b in m) for p, m in rows)
    assert packed_tokens == batch.num_tokens - (2 * 3 + 4 * 2 + 5 * 1)
    # a tight budget splits a group over several rows, each repeating the prompt
    assert len(plan_rows(batch, 8)) > 3


def test_packed_logprobs_match_a_padded_forward(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from tokenmill.training.packing import packed_token_stats

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    samples = _groups(len(tokenizer), seed=1)
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    with torch.no_grad():
        dense = token_logprobs(model(input_ids=batch.input_ids_B_T).logits, batch.input_ids_B_T, 0.7)
        seen = 0
        for micro, packed in micro_packs(batch, 10_000):
            lp, ent = packed_token_stats(model, packed, tuple(micro.input_ids_B_T.shape), temperature=0.7,
                                         entropy=True)
            assert ent is not None and bool((ent >= 0).all())
            for row in range(micro.size):
                # find the batch row this micro row came from (rows are unique token sequences here)
                n, p = int(micro.lengths_B[row]), int(micro.prompt_lens_B[row])
                match = [b for b in range(batch.size) if torch.equal(batch.input_ids_B_T[b, :n], micro.input_ids_B_T[row, :n])
                         and int(batch.lengths_B[b]) == n]
                assert len(match) == 1
                torch.testing.assert_close(lp[row, p:n], dense[match[0], p:n], atol=1e-5, rtol=0)
                assert bool((lp[row, :p] == 0).all())
                seen += 1
    assert seen == len(samples)


@pytest.mark.parametrize("budget", [10_000, 12])
def test_packed_gradients_equal_padded_gradients(tiny_model_path, tokenizer, budget):
    samples = _groups(len(tokenizer))
    plain, m_plain, _ = _run(tiny_model_path, samples, share=False)
    packed, m_packed, _ = _run(tiny_model_path, samples, share=True, budget=budget)
    assert plain.keys() == packed.keys() and any(g.abs().sum() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(packed[name], plain[name], atol=2e-6, rtol=1e-4, msg=name)
    for key in ("loss", "ratio_mean", "weight", "entropy"):
        assert m_packed[key] == pytest.approx(m_plain[key], abs=1e-5), key


@pytest.mark.parametrize("share", [True, False])
def test_entropy_bonus_gradient_by_autograd(tiny_model_path, tokenizer, share):
    """With zero advantages the policy term has no gradient, so the update is exactly -coef x grad(entropy)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.training.local import token_entropy

    samples = [s.with_(advantage=0.0) for s in _groups(len(tokenizer), seed=2)]
    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    batch = collate(samples, weights, pad_id=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, share_prompts=share)
    metrics = backend.forward_backward(batch, _batch_loss("ppo_clip", AlgorithmConfig()), entropy_coef=0.3)
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    manual = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    entropy = (token_entropy(manual(input_ids=batch.input_ids_B_T).logits, 1.0) * batch.weights_B_T).sum()
    (-0.3 * entropy).backward()
    assert metrics["loss"] == pytest.approx(-0.3 * entropy.item(), abs=1e-5)
    assert metrics["entropy"] == pytest.approx(entropy.item(), abs=1e-5)
    for name, p in manual.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=2e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("budget", [10_000, 12])
def test_reference_logprobs_packed_equal_padded_on_trained_tokens(tiny_model_path, tokenizer, budget):
    from transformers import AutoModelForCausalLM

    from tokenmill.training.local import batch_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    samples = _groups(len(tokenizer), seed=3)
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    packed = batch_logprobs(model, batch, temperature=0.7, token_budget=budget, share_prompts=True)
    padded = batch_logprobs(model, batch, temperature=0.7, token_budget=budget, share_prompts=False)
    trained = batch.weights_B_T > 0
    assert int(trained.sum()) > 10
    torch.testing.assert_close(packed[trained], padded[trained], atol=1e-5, rtol=0)
    assert bool((packed[~trained] == 0).all())


def _uneven_groups(vocab: int, seed: int = 3) -> list[Sample]:
    """One wide group (3-token prompt, four 6-token completions: 27 packed tokens) and two narrow ones
    (2-token prompts, two completions of 1-3 tokens: at most 8 each), which fit side by side in one row."""
    rng = random.Random(seed)
    out = []
    for prompt_len, count, longest in ((3, 4, 6), (2, 2, 3), (2, 2, 3)):
        prompt = [rng.randint(3, vocab - 1) for _ in range(prompt_len)]
        for _ in range(count):
            n = longest if longest == 6 else rng.randint(1, longest)
            completion = [rng.randint(3, vocab - 1) for _ in range(n)]
            out.append(Sample(
                tokens=tuple(prompt + completion), loss_mask=(0,) * prompt_len + (1,) * n,
                logprobs=(0.0,) * prompt_len + tuple(-rng.uniform(1.0, 4.0) for _ in completion),
                prompt_len=prompt_len, prompt="p", completion="c", stop_reason=StopReason.STOP,
                advantage=rng.uniform(-1.5, 1.5),
            ))
    return out


def test_narrow_groups_share_a_packed_row_with_the_same_numbers(tiny_model_path, tokenizer):
    """`plan_lines` lays the two narrow groups side by side (positions restart, neither sees the other), so
    the micro-batch pads to 27 columns, not 2 x 27 rows; logprobs and gradients stay those of padded rows."""
    from transformers import AutoModelForCausalLM

    from tokenmill.training.packing import packed_token_stats, plan_lines

    samples = _uneven_groups(len(tokenizer))
    batch = collate(samples, [1.0] * len(samples), pad_id=0)
    lines = plan_lines(batch, 10_000)
    assert [len(line) for _, line in lines] == [1, 2] and lines[0][0] == 27 and lines[1][0] <= 27
    [(micro, packed)] = list(micro_packs(batch, 10_000))
    assert packed.input_ids_R_L.shape == (2, 27) and packed.layout == () and packed.group_R_L is not None
    # the second group of row 1 restarts its positions at 0 and sees none of the first group's tokens
    second = packed.group_R_L[1] == 1
    assert int(packed.position_ids_R_L[1][second][0]) == 0
    assert not packed.allowed_R_L_L[1][second][:, packed.group_R_L[1] == 0].any()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp, _ = packed_token_stats(model, packed, tuple(micro.input_ids_B_T.shape), temperature=0.7, entropy=False)
        dense = token_logprobs(model(input_ids=micro.input_ids_B_T).logits, micro.input_ids_B_T, 0.7)
    mask = micro.weights_B_T > 0
    torch.testing.assert_close(lp[mask], dense[mask], atol=1e-5, rtol=0)
    plain, _, _ = _run(tiny_model_path, samples, share=False)
    lined, _, _ = _run(tiny_model_path, samples, share=True)
    for name in plain:
        torch.testing.assert_close(lined[name], plain[name], atol=2e-6, rtol=1e-4, msg=name)
