"""The ground truth engines are checked against: logprobs from one plain teacher-forced forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def teacher_logprobs(model, prompt: Sequence[int], completion: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log p(completion_k | prompt, completion_<k) under softmax(logits / temperature), from one forward pass
    over the whole sequence (no cache, no padding, no batching)."""
    logits = model(torch.tensor([list(prompt) + list(completion)])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion)]
