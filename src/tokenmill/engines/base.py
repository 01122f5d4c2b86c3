"""The inference-engine protocol: token ids in, sampled token ids and their logprobs out.

    >>> engine = HFEngine.from_pretrained("path/to/model")                       # doctest: +SKIP
    >>> [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))      # doctest: +SKIP
    >>> len(c.token_ids) == len(c.logprobs)                                      # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from tokenmill.types import Completion, SamplingParams, TokenmillError


class EngineUnavailable(TokenmillError):
    """The engine cannot answer the request. In process: it is closed, its loop crashed (the cause is
    chained) or its queue is full (`EngineBusy`). Remote: no server answered within the retries (the message
    names each server and its last error)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples completions. Logprobs are of the sampled token under softmax(logits / temperature)."""

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Return `params.n` completions for each prompt, in prompt order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place (no reload) and record the policy version they belong to."""
        ...
