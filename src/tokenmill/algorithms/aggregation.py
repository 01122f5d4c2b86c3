"""Loss aggregation as per-token weights, computed once per mini-batch.

A mini-batch of sequences with `n_i` trained tokens each gets weights that sum to 1:
  token_mean      w = 1 / sum_i n_i                       (every token counts the same; DAPO, TRL default)
  sequence_mean   w = 1 / (n_i * num_sequences)           (every sequence counts the same; original GRPO)
  token_sum_norm  w = 1 / (num_sequences * max_tokens)    (a constant; Dr.GRPO's unbiased form)
Weights are decided over the *whole* mini-batch, so dropping samples from the forward pass (zero
advantage) or splitting into micro-batches leaves every gradient unchanged.
"""

from __future__ import annotations

from typing import Literal

Aggregation = Literal["token_mean", "sequence_mean", "token_sum_norm"]


def token_weights(
    trained_tokens: list[int], mode: Aggregation, max_tokens: int | None = None
) -> list[float]:
    """The per-token weight of each sequence, given each sequence's number of trained tokens."""
    n = len(trained_tokens)
    if n == 0:
        return []
    if mode == "token_mean":
        total = sum(trained_tokens)
        return [1.0 / total if total else 0.0] * n
    if mode == "sequence_mean":
        return [1.0 / (k * n) if k else 0.0 for k in trained_tokens]
    if mode == "token_sum_norm":
        if not max_tokens:
            raise ValueError("token_sum_norm needs max_tokens")
        return [1.0 / (n * max_tokens)] * n
    raise ValueError(f"unknown loss aggregation {mode!r}")
