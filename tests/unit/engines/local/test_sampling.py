"""The one sampling kernel (`engines.local.sampling`): its distribution, its logprob, and that both of its
callers draw exactly the tokens they drew when each had a kernel of its own."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engines import sample_tokens
from tokenmill.engines.local.sampling import inverse_cdf, sample_rows
from tokenmill.types import SamplingParams


def test_sample_tokens_top_p_small_picks_the_top_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    params = SamplingParams(top_p=1e-3, temperature=1.3)
    for _ in range(5):
        tokens, logprobs = sample_tokens(logits, params, g)
        assert torch.equal(tokens, logits.argmax(-1))
        expected = torch.log_softmax(logits / 1.3, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs, expected)


def test_sample_tokens_top_k_and_top_p_keep_only_the_head():
    g = torch.Generator().manual_seed(1)
    # probabilities 0.5, 0.3, 0.1, 0.1 (as logits): top_p 0.7 keeps {0, 1}; top_k 3 keeps {0, 1, 2 or 3}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]])).repeat(400, 1)
    tokens, _ = sample_tokens(logits, SamplingParams(top_p=0.7), g)
    assert set(tokens.tolist()) == {0, 1}
    tokens, logprobs = sample_tokens(logits, SamplingParams(top_k=2), g)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.5, 0.3]))[tokens])
    # about 5/8 of the draws are token 0 once the tail is removed
    assert 0.5 < (tokens == 0).float().mean().item() < 0.75


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    # u spans [0, 1): the token whose cumulative interval holds u, never one of probability 0
    u = torch.tensor([0.0, 0.49, 0.5, 0.69, 0.7, 0.9999999])
    assert inverse_cdf(probs.repeat(6, 1), u).tolist() == [1, 1, 3, 3, 4, 4]
    g = torch.Generator().manual_seed(3)
    rows = 20_000
    tokens = inverse_cdf(probs.repeat(rows, 1), torch.rand(rows, generator=g))
    freq = torch.bincount(tokens, minlength=6).float() / rows
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs, atol=0.015), freq  # 3 standard errors at 20,000 draws
    # unnormalised rows (top-k / top-p leave a softmax over fewer tokens: still sums to 1, but be safe)
    assert inverse_cdf(torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([0.75])).tolist() == [2]


def test_sample_rows_draws_from_each_rows_own_distribution():
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    count = 20_000  # 4 parameter settings interleaved in one batch
    temperature_B = torch.tensor([1.0, 0.5, 1.0, 2.0]).repeat(count)
    top_k_B = torch.tensor([0, 0, 3, 0]).repeat(count)
    top_p_B = torch.tensor([1.0, 1.0, 1.0, 0.8]).repeat(count)
    greedy_B = torch.tensor([False, False, False, False]).repeat(count)
    tokens_B, logp_B = sample_rows(logits_V.expand(4 * count, -1), temperature=temperature_B, top_p=top_p_B,
                                   top_k=top_k_B, greedy=greedy_B,
                                   uniform_B=torch.rand(4 * count, generator=torch.Generator().manual_seed(0)))
    for setting, (temperature, keep) in enumerate([(1.0, 6), (0.5, 6), (1.0, 3), (2.0, None)]):
        probs_V = torch.softmax(logits_V / temperature, dim=-1)
        if keep is None:  # top-p 0.8 at temperature 2: the smallest prefix of sorted tokens reaching 0.8
            keep = int((probs_V.cumsum(0) - probs_V < 0.8).sum())
        target_V = torch.zeros(6)
        target_V[:keep] = probs_V[:keep] / probs_V[:keep].sum()  # logits are sorted: the kept ones come first
        drawn = tokens_B[setting::4]
        freq_V = torch.bincount(drawn, minlength=6).float() / count
        assert (freq_V - target_V).abs().max() < 0.015, (setting, freq_V, target_V)
        # the logprob is the full tempered distribution's, not the truncated one's
        assert torch.allclose(logp_B[setting::4], torch.log(probs_V)[drawn], atol=1e-6)
    greedy, _ = sample_rows(logits_V.expand(2, -1), temperature=torch.ones(2), top_p=torch.ones(2),
                            top_k=torch.zeros(2, dtype=torch.long), greedy=torch.tensor([True, True]),
                            uniform_B=torch.tensor([0.99, 0.5]))
    assert greedy.tolist() == [0, 0]




# --- the kernel both engines had before it was one (copied as they were) -------------------------------------


def _former_sample_tokens(logits_B_V, params, generator):
    """`HFEngine`'s kernel: one SamplingParams for every row."""
    scaled_B_V = logits_B_V.float() / params.temperature
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    if params.greedy:
        tokens_B = scaled_B_V.argmax(dim=-1)
        return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)
    filtered_B_V = scaled_B_V
    if params.top_k and params.top_k < filtered_B_V.shape[-1]:
        kth_B_1 = torch.topk(filtered_B_V, params.top_k, dim=-1).values[:, -1:]
        filtered_B_V = filtered_B_V.masked_fill(filtered_B_V < kth_B_1, float("-inf"))
    if params.top_p < 1.0:
        sorted_B_V, order_B_V = torch.sort(filtered_B_V, dim=-1, descending=True)
        cum_B_V = torch.softmax(sorted_B_V, dim=-1).cumsum(dim=-1)
        drop_sorted_B_V = (cum_B_V - torch.softmax(sorted_B_V, dim=-1)) >= params.top_p
        drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter(1, order_B_V, drop_sorted_B_V)
        filtered_B_V = filtered_B_V.masked_fill(drop_B_V, float("-inf"))
    uniform_B = torch.rand(filtered_B_V.shape[0], generator=generator, device=filtered_B_V.device)
    tokens_B = inverse_cdf(torch.softmax(filtered_B_V, dim=-1), uniform_B)
    return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)


def _former_sample_rows(logits_B_V, *, temperature_B, top_p_B, top_k_B, greedy_B, uniform_B):
    """`ContinuousEngine`'s kernel: per-row parameters."""
    vocab = logits_B_V.shape[-1]
    scaled_B_V = logits_B_V.float() / temperature_B[:, None].float()
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    filtered_B_V = scaled_B_V
    if bool((top_k_B > 0).any()):
        k_B = torch.where(top_k_B > 0, top_k_B, vocab).clamp(max=vocab)
        kth_B_1 = torch.sort(scaled_B_V, dim=-1, descending=True).values.gather(1, (k_B - 1)[:, None])
        filtered_B_V = filtered_B_V.masked_fill(filtered_B_V < kth_B_1, float("-inf"))
    if bool((top_p_B < 1.0).any()):
        sorted_B_V, order_B_V = torch.sort(filtered_B_V, dim=-1, descending=True)
        probs_sorted_B_V = torch.softmax(sorted_B_V, dim=-1)
        drop_sorted_B_V = (probs_sorted_B_V.cumsum(dim=-1) - probs_sorted_B_V) >= top_p_B[:, None]
        drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter(1, order_B_V, drop_sorted_B_V)
        filtered_B_V = filtered_B_V.masked_fill(drop_B_V, float("-inf"))
    tokens_B = inverse_cdf(torch.softmax(filtered_B_V, dim=-1), uniform_B)
    tokens_B = torch.where(greedy_B, scaled_B_V.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)


SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.8),
    SamplingParams(top_k=257),  # the whole vocabulary: off
    SamplingParams(top_p=1e-3),
    SamplingParams(greedy=True, temperature=0.5),
]


def _logits(seed: int, rows: int = 33, vocab: int = 257) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, :8] = logits[:, 8:16]  # ties, so the k-th value appears twice in a row
    return logits


@pytest.mark.parametrize("params", SETTINGS, ids=repr)
def test_broadcast_scalars_draw_what_the_former_batch_wide_kernel_drew(params):
    """HFEngine's tokens and logprobs are unchanged, bit for bit, on the same seed (and the generator is left
    where it was: greedy draws nothing)."""
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for step in range(4):
        logits = _logits(step)
        tokens, logprobs = sample_tokens(logits, params, ours)
        want_tokens, want_logprobs = _former_sample_tokens(logits, params, theirs)
        assert torch.equal(tokens, want_tokens)
        assert torch.equal(logprobs, want_logprobs)
    assert torch.equal(ours.get_state(), theirs.get_state())


def _table(rows: int) -> torch.Tensor:
    """Per-row parameters as ContinuousEngine builds them: one float64 row of (temperature, top_p, top_k,
    greedy, uniform) per sequence, the settings above taken in turn."""
    g = torch.Generator().manual_seed(11)
    uniforms = torch.rand(rows, generator=g).tolist()
    specs = [(p.temperature, p.top_p, float(p.top_k), float(p.greedy)) for p in SETTINGS]
    return torch.tensor([(*specs[i % len(specs)], uniforms[i]) for i in range(rows)], dtype=torch.float64)


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_per_row_tensors_draw_what_the_former_per_row_kernel_drew(rows):
    logits = _logits(rows, rows=rows)
    table_B_5 = _table(rows)
    tokens, logprobs = sample_rows(logits, temperature=table_B_5[:, 0], top_p=table_B_5[:, 1],
                                   top_k=table_B_5[:, 2].long(), greedy=table_B_5[:, 3].bool(),
                                   uniform_B=table_B_5[:, 4])
    want_tokens, want_logprobs = _former_sample_rows(
        logits, temperature_B=table_B_5[:, 0], top_p_B=table_B_5[:, 1], top_k_B=table_B_5[:, 2].long(),
        greedy_B=table_B_5[:, 3].bool(), uniform_B=table_B_5[:, 4])
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logprobs, want_logprobs)


def test_a_scalar_and_a_tensor_of_that_scalar_draw_the_same_tokens():
    """The two ways of passing a parameter are one kernel: every row given the same value as a tensor samples
    what the Python number samples (values exact in float32, so no rounding of top_p can differ)."""
    logits, rows = _logits(5), 33
    uniform_B = torch.rand(rows, generator=torch.Generator().manual_seed(2))
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.5, 0.75, 0), (2.0, 1.0, 7), (0.75, 0.5, 30)]:
        scalar = sample_rows(logits, temperature=temperature, top_p=top_p, top_k=top_k, greedy=False,
                             uniform_B=uniform_B)
        tensor = sample_rows(logits, temperature=torch.full((rows,), temperature), top_p=torch.full((rows,), top_p),
                             top_k=torch.full((rows,), top_k), greedy=torch.zeros(rows, dtype=torch.bool),
                             uniform_B=uniform_B)
        assert torch.equal(scalar[0], tensor[0]) and torch.equal(scalar[1], tensor[1]), (temperature, top_p, top_k)
    assert not torch.equal(scalar[0], sample_rows(logits, temperature=0.75, top_p=1.0, top_k=0, greedy=False,
                                                  uniform_B=uniform_B)[0])  # the filters did change the draws
