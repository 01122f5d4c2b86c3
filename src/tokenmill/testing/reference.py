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


def assert_same_completions(a, b, tol: float = 1e-5) -> None:
    """Two engines' outputs (`list[list[Completion]]`, or flat lists) hold the same tokens and stop reasons,
    and logprobs within `tol`; and the comparison is not vacuous (some row decoded more than one token, or
    rows stopped at different steps)."""
    flat_a = [c for group in a for c in (group if isinstance(group, list) else [group])]
    flat_b = [c for group in b for c in (group if isinstance(group, list) else [group])]
    assert [c.token_ids for c in flat_a] == [c.token_ids for c in flat_b]
    assert [c.stop_reason for c in flat_a] == [c.stop_reason for c in flat_b]
    worst = max(abs(x - y) for ca, cb in zip(flat_a, flat_b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert worst < tol, f"largest logprob difference {worst:.2e}"
    lengths = {len(c.token_ids) for c in flat_a}
    assert len(lengths) > 1 or max(lengths) > 1


@torch.no_grad()
def image_token_logprobs(model, tokens: Sequence[int], images) -> torch.Tensor:
    """log p(token_t | tokens_<t, images) for t >= 1 of a Qwen2-VL-family model, from its own forward over the
    whole sequence with the pixel values (`images`: `ImageInputs`; token types 1 at the image tokens, as its
    processor marks them): the trainer's and the teacher's image paths are checked against it."""
    ids = torch.tensor([list(tokens)])
    kinds = (ids == model.config.image_token_id).int()
    logits = model(input_ids=ids, pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                   mm_token_type_ids=kinds).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
