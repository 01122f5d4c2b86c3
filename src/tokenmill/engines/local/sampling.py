"""The one sampling kernel of the in-process engines: top-k, then top-p of what is left, then one draw per row
by inverse CDF from a given uniform.

Every parameter is either one Python number for the whole batch (`HFEngine`: one `SamplingParams` per call)
or a per-row tensor (`ContinuousEngine`: requests with different parameters decoded together). A Python
number stays a scalar in the arithmetic, so the batch-wide call computes exactly what it always did (a
division by a scalar and by a tensor may round differently on a GPU).

top-k / top-p shape the sampling distribution only; the returned logprob is the tempered full distribution's,
the same quantity the trainer recomputes (as TRL and verl do).
"""

from __future__ import annotations

import torch

from tokenmill.types import SamplingParams

Param = float | int | bool | torch.Tensor  # one value for every row, or one per row [B]


def _column(value: Param) -> Param:
    """A per-row tensor as a [B, 1] column, which broadcasts against [B, V]; a scalar as it is."""
    return value[:, None] if isinstance(value, torch.Tensor) else value


def sample_rows(logits_B_V: torch.Tensor, *, temperature: Param, top_p: Param, top_k: Param, greedy: Param,
                uniform_B: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens_B, logprobs_B) under softmax(logits / temperature).

    temperature, top_p, top_k, greedy: each a number for every row or a tensor [B] (top_k 0 and top_p 1 are off)
    uniform_B: the draws in [0, 1), one per row; None only when `greedy` is one true value for every row
    """
    vocab = logits_B_V.shape[-1]
    scaled_B_V = logits_B_V.float() / (_column(temperature).float() if isinstance(temperature, torch.Tensor)
                                      else temperature)
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    if not isinstance(greedy, torch.Tensor) and greedy:
        tokens_B = scaled_B_V.argmax(dim=-1)
        return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)
    filtered_B_V = scaled_B_V
    kth_B_1 = _kth_largest(scaled_B_V, top_k, vocab)
    if kth_B_1 is not None:
        filtered_B_V = filtered_B_V.masked_fill(filtered_B_V < kth_B_1, float("-inf"))
    if bool((top_p < 1.0).any()) if isinstance(top_p, torch.Tensor) else top_p < 1.0:
        sorted_B_V, order_B_V = torch.sort(filtered_B_V, dim=-1, descending=True)
        probs_sorted_B_V = torch.softmax(sorted_B_V, dim=-1)
        drop_sorted_B_V = (probs_sorted_B_V.cumsum(dim=-1) - probs_sorted_B_V) >= _column(top_p)  # keeps the first
        drop_B_V = torch.zeros_like(drop_sorted_B_V).scatter(1, order_B_V, drop_sorted_B_V)
        filtered_B_V = filtered_B_V.masked_fill(drop_B_V, float("-inf"))
    tokens_B = inverse_cdf(torch.softmax(filtered_B_V, dim=-1), uniform_B)
    if isinstance(greedy, torch.Tensor):
        tokens_B = torch.where(greedy, scaled_B_V.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)


def _kth_largest(scaled_B_V: torch.Tensor, top_k: Param, vocab: int) -> torch.Tensor | None:
    """Each row's k-th largest value [B, 1] (-inf where its top-k is off: 0 or the whole vocabulary), or None
    when top-k is off for every row."""
    if not isinstance(top_k, torch.Tensor):
        return torch.topk(scaled_B_V, top_k, dim=-1).values[:, -1:] if 0 < top_k < vocab else None
    on_B = (top_k > 0) & (top_k < vocab)
    if not bool(on_B.any()):
        return None
    k_B = torch.where(on_B, top_k, 1)
    kth_B_1 = torch.topk(scaled_B_V, int(k_B.max()), dim=-1).values.gather(1, (k_B - 1)[:, None])
    return kth_B_1.masked_fill(~on_B[:, None], float("-inf"))


def sample_tokens(
    logits_B_V: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` with one `SamplingParams` for every row, the uniforms drawn from `generator` (none when
    greedy); returns (tokens_B, logprobs_B)."""
    uniform_B = None if params.greedy else torch.rand(logits_B_V.shape[0], generator=generator,
                                                       device=logits_B_V.device)
    return sample_rows(logits_B_V, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                       greedy=params.greedy, uniform_B=uniform_B)


def inverse_cdf(probs_B_V: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from `probs_B_V` by the uniforms in [0, 1): the first token whose cumulative
    probability exceeds u (a zero-probability token never is). The same distribution as `torch.multinomial`,
    at a fraction of its cost on a CPU (one uniform per row instead of one exponential per vocabulary entry)."""
    cdf_B_V = probs_B_V.cumsum(dim=-1)
    target_B_1 = (uniform_B.float() * cdf_B_V[:, -1])[:, None]
    return torch.searchsorted(cdf_B_V, target_B_1, right=True).squeeze(1).clamp(max=probs_B_V.shape[-1] - 1)
