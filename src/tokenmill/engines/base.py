"""The inference-engine protocol: token ids in, sampled token ids and their logprobs out.

    >>> engine = HFEngine.from_pretrained("path/to/model")                       # doctest: +SKIP
    >>> [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))      # doctest: +SKIP
    >>> len(c.token_ids) == len(c.logprobs)                                      # doctest: +SKIP
    True
    >>> state = engine.state_dict()            # its sampling RNG, for an exact resume  # doctest: +SKIP
    >>> engine.load_state_dict(state); engine.close()                            # doctest: +SKIP

This is everything the loop and the rollouts call on an engine. In-process engines (`HFEngine`,
`ContinuousEngine`) also expose `tokenizer`, `device` and `model`, which only the builders use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from tokenmill.types import Completion, PromptLogprobs, SamplingParams, TokenmillError


class EngineUnavailable(TokenmillError):
    """The engine cannot answer the request. In process: it is closed, its loop crashed (the cause is
    chained) or its queue is full (`EngineBusy`). Remote: no server answered within the retries (the message
    names each server and its last error)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples completions. Logprobs are of the sampled token under softmax(logits / temperature).

    version:  the policy version (trainer steps) of the weights it samples from
    pad_id:   the token id the trainer pads its batches with (the engine's tokenizer's)
    """

    version: int
    pad_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Return `params.n` completions for each prompt, in prompt order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place (no reload) and record the policy version they belong to."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue sampling the same stream (the RNG state; {} when the sampling
        happens elsewhere, as on a server)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output."""
        ...

    def close(self) -> None:
        """Release threads, connections and servers; idempotent."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Scores given token sequences (teacher forcing): the logprob of each token after the first, under
    softmax of the raw logits (temperature 1), and optionally the `top_k` most likely tokens at each position.
    The weight-sync probe and on-policy distillation (a teacher's logprobs) use it.

    Raises ValueError for a bad request (an empty sequence, a token id outside the vocabulary, top_k < 0),
    the message starting with the field it is about."""

    def score(self, sequences: list[list[int]], top_k: int = 0) -> list[PromptLogprobs]:
        """One `PromptLogprobs` per sequence, in order."""
        ...


def call_seed(seed: int, version: int, index: int) -> int:
    """The sampling seed of the `index`-th generate call on weights of `version` (also the per-request seed the
    process placement's `RemoteEngine(seed=...)` sends its own servers)."""
    return ((seed * 1_000_003 + version) * 1_000_003 + index) % (1 << 62)
