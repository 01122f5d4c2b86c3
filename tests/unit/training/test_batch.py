"""Batch collation, micro-batching, and gradient invariance under micro-batching on a tiny real model."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.algorithms import token_weights
from tokenmill.config import AlgorithmConfig
from tokenmill.training import LocalBackend, collate, token_logprobs
from tokenmill.training.update import _batch_loss
from tokenmill.types import Sample, StopReason

PAD = 0


def _sample(tokens, prompt_len, *, advantage=0.0, logprobs=None):
    n = len(tokens)
    mask = (0,) * prompt_len + (1,) * (n - prompt_len)
    if logprobs is None:
        logprobs = tuple(0.0 if m == 0 else -0.1 * (i + 1) for i, m in enumerate(mask))
    return Sample(
        tokens=tuple(tokens), loss_mask=mask, logprobs=tuple(logprobs), prompt_len=prompt_len, prompt="p",
        completion="c", stop_reason=StopReason.STOP, advantage=advantage,
    )


def test_collate_sorts_pads_and_weights_by_hand():
    samples = [
        _sample([11, 12, 13], 1, advantage=0.5),            # length 3
        _sample([21, 22, 23, 24, 25], 2, advantage=-1.0),   # length 5
        _sample([31, 32], 1, advantage=2.0),                # length 2
    ]
    batch = collate(samples, [0.1, 0.2, 0.3], pad_id=PAD)
    # longest first: samples 1, 0, 2
    assert batch.lengths_B.tolist() == [5, 3, 2]
    assert batch.sample_index_B.tolist() == [1, 0, 2] and batch.prompt_lens_B.tolist() == [2, 1, 1]
    assert batch.input_ids_B_T.tolist() == [
        [21, 22, 23, 24, 25],
        [11, 12, 13, PAD, PAD],
        [31, 32, PAD, PAD, PAD],
    ]
    assert batch.advantages_B.tolist() == [-1.0, 0.5, 2.0]
    # weights only on loss-mask (completion) tokens, scaled by each sample's weight; zero on padding
    torch.testing.assert_close(batch.weights_B_T, torch.tensor([
        [0.0, 0.0, 0.2, 0.2, 0.2],
        [0.0, 0.1, 0.1, 0.0, 0.0],
        [0.0, 0.3, 0.0, 0.0, 0.0],
    ]))
    torch.testing.assert_close(batch.old_logprobs_B_T, torch.tensor([
        [0.0, 0.0, -0.3, -0.4, -0.5],
        [0.0, -0.2, -0.3, 0.0, 0.0],
        [0.0, -0.2, 0.0, 0.0, 0.0],
    ]))
    assert batch.input_ids_B_T.dtype == torch.long and batch.weights_B_T.dtype == torch.float32
    assert batch.size == 3 and batch.num_tokens == 10 and batch.ref_logprobs_B_T is None


def test_collate_token_mean_weights_sum_to_one():
    samples = [_sample(list(range(1, n + 1)), 2) for n in (4, 7, 3)]
    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    batch = collate(samples, weights, pad_id=PAD)
    assert batch.weights_B_T.sum().item() == pytest.approx(1.0)
    # every weighted position is a real, trained token
    real = torch.arange(batch.input_ids_B_T.shape[1])[None, :] < batch.lengths_B[:, None]
    assert ((batch.weights_B_T > 0) <= real).all()


def test_micro_batches_by_hand():
    lengths = [7, 5, 5, 3, 2, 2, 1]
    samples = [_sample(list(range(1, n + 1)), 0) for n in lengths]
    batch = collate(samples, [1.0] * len(samples), pad_id=PAD)
    micros = list(batch.micro_batches(10))
    # width 7: 2 rows would be 14 > 10; width 5: 2 rows = 10; width 3: 3 rows = 9; the last row alone
    assert [m.lengths_B.tolist() for m in micros] == [[7], [5, 5], [3, 2, 2], [1]]
    assert [tuple(m.input_ids_B_T.shape) for m in micros] == [(1, 7), (2, 5), (3, 3), (1, 1)]
    assert micros[2].input_ids_B_T.tolist() == [[1, 2, 3], [1, 2, PAD], [1, 2, PAD]]


@pytest.mark.parametrize("budget", [1, 5, 8, 13, 30, 1000])
def test_micro_batches_cover_every_row_once_within_budget(budget):
    rng = random.Random(budget)
    samples = [_sample([rng.randint(1, 90) for _ in range(rng.randint(2, 12))], 1) for _ in range(17)]
    weights = [rng.random() for _ in samples]
    batch = collate(samples, weights, pad_id=PAD)
    lengths = batch.lengths_B.tolist()
    assert lengths == sorted(lengths, reverse=True)
    rows = 0
    for micro in batch.micro_batches(budget):
        b, width = micro.input_ids_B_T.shape
        assert width == int(micro.lengths_B.max())  # trimmed to its own longest row
        assert b * width <= budget or b == 1  # a row longer than the budget goes alone
        # the slice is exactly the rows [rows, rows + b) of the full batch
        torch.testing.assert_close(micro.input_ids_B_T, batch.input_ids_B_T[rows : rows + b, :width])
        torch.testing.assert_close(micro.weights_B_T, batch.weights_B_T[rows : rows + b, :width])
        torch.testing.assert_close(micro.old_logprobs_B_T, batch.old_logprobs_B_T[rows : rows + b, :width])
        torch.testing.assert_close(micro.advantages_B, batch.advantages_B[rows : rows + b])
        # nothing trimmed away carried weight
        assert batch.weights_B_T[rows : rows + b, width:].abs().sum().item() == 0.0
        rows += b
    assert rows == batch.size


def test_token_logprobs_equals_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    for temperature in (1.0, 0.7):
        out = token_logprobs(logits, ids, temperature)
        assert out.shape == (2, 5)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for b in range(2):
            assert out[b, 0].item() == 0.0
            for t in range(1, 5):
                assert out[b, t].item() == pytest.approx(logp[b, t - 1, ids[b, t]].item(), abs=1e-5)


def _rl_samples(vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate([12, 9, 9, 6, 4, 3]):
        tokens = [rng.randint(3, vocab - 1) for _ in range(n)]
        prompt_len = 2
        logprobs = [0.0] * prompt_len + [-rng.uniform(2.0, 6.0) for _ in range(n - prompt_len)]
        out.append(_sample(tokens, prompt_len, advantage=[1.0, -0.5, 0.3, -1.2, 0.8, 0.0][i], logprobs=logprobs))
    return out


def _grads(model_path, samples, micro_batch_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, micro_batch_tokens=micro_batch_tokens)
    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    batch = collate(samples, weights, pad_id=PAD)
    metrics = backend.forward_backward(batch, _batch_loss("ppo_clip", AlgorithmConfig()))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, metrics, len(list(batch.micro_batches(micro_batch_tokens)))


def test_gradients_are_invariant_to_micro_batching(tiny_model_path, tokenizer):
    samples = _rl_samples(len(tokenizer))
    big, m_big, n_big = _grads(tiny_model_path, samples, 10_000)
    small, m_small, n_small = _grads(tiny_model_path, samples, 16)
    assert n_big == 1 and n_small == 5  # lengths 12 | 9 | 9 | 6, 4 | 3 under a budget of 16
    assert big.keys() == small.keys() and len(big) > 0
    assert any(g.abs().sum() > 0 for g in big.values())
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=1e-6, rtol=0, msg=name)
    for key in ("loss", "clip_fraction", "ratio_mean", "weight", "entropy"):
        assert m_small[key] == pytest.approx(m_big[key], abs=1e-5), key
    assert m_big["weight"] == pytest.approx(1.0, abs=1e-6)
