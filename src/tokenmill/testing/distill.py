"""Distillation test kit: samples of real text whose sampler logprobs are the policy's own (so the policy
ratio is 1), the token ids of a string spelled out by hand, and the trainer's loss on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.types import Group, Sample, StopReason


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """A character tokenizer's ids of `text`, one lookup per character (independent of the encode path)."""
    return [tokenizer.convert_tokens_to_ids(ch) for ch in text]


@torch.no_grad()
def own_logprobs(model: torch.nn.Module, tokens: Sequence[int]) -> list[float]:
    """`model`'s logprob of each token given the ones before (0.0 for the first)."""
    ids = torch.tensor([list(tokens)])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return [0.0, *logp.tolist()]


def text_groups(model: torch.nn.Module, tokenizer: Any, rows: Sequence[tuple[dict, Sequence[str]]]) -> list[Group]:
    """One group per `(row, completions)`: the row's `prompt` followed by each completion, with `model`'s own
    logprobs as the sampler's, reward 1, and the row attached (what routing and templates read)."""
    groups = []
    for g, (row, completions) in enumerate(rows):
        p = char_ids(tokenizer, row["prompt"])
        samples = []
        for text in completions:
            tokens = p + char_ids(tokenizer, text)
            samples.append(Sample(
                tokens=tuple(tokens), loss_mask=(0,) * len(p) + (1,) * len(text),
                logprobs=tuple(own_logprobs(model, tokens)), prompt_len=len(p), prompt=row["prompt"],
                completion=text, stop_reason=StopReason.STOP, group_id=g, reward=1.0, row=dict(row)))
        groups.append(Group(g, tuple(samples)))
    return groups


def trainer_loss(model: torch.nn.Module, samples: Sequence[Sample]) -> float:
    """The local trainer's clipped policy loss (token-mean weights) on the samples' per-token advantages."""
    from tokenmill.algorithms import ppo_clip_loss
    from tokenmill.algorithms.aggregation import token_weights
    from tokenmill.training.batch import collate
    from tokenmill.training.spec import TrainerSpec, policy_backend

    weights = token_weights([sum(s.loss_mask) for s in samples], "token_mean")
    backend = policy_backend(TrainerSpec(learning_rate=0.0, total_steps=1), model)
    metrics = backend.forward_backward(collate(list(samples), weights, 0), lambda lp, b: ppo_clip_loss(
        lp, b.old_logprobs_B_T, b.advantages, b.weights_B_T))
    model.zero_grad(set_to_none=True)
    return metrics["loss"]
