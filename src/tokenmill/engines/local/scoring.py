"""Teacher-forced scoring of token sequences on an in-process model: the `Scorer` of the HF engines.

Each position's logprob is computed as the trainer computes it (`training/local.py` `token_logprobs`):
the gathered logit minus the logsumexp, in fp32, so an engine sharing the trainer's weights scores exactly
what the trainer would.
"""

from __future__ import annotations

import torch

from tokenmill.types import PromptLogprobs

MAX_TOP_K = 1 << 10  # alternatives per position at most (a distillation teacher needs tens)


def check_score_request(sequences: list[list[int]], top_k: int, vocab_size: int, max_positions: int | None,
                        *, field: str = "sequences", top_field: str = "top_k") -> list[list[int]]:
    """The sequences as lists of ints, or ValueError naming the field: a sequence must be non-empty, fit the
    model's context and hold ids in [0, vocab_size); top_k in [0, MAX_TOP_K]."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"{top_field}: a whole number in [0, {MAX_TOP_K}], got {top_k!r}")
    out = []
    for i, seq in enumerate(sequences):
        ids = [int(t) for t in seq]
        if not ids:
            raise ValueError(f"{field}: sequence {i} is empty (at least one token)")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} of sequence {i} is outside the vocabulary [0, {vocab_size})")
        if max_positions and len(ids) > max_positions:
            raise ValueError(f"{field}: sequence {i} has {len(ids)} tokens, over the model's context of "
                             f"{max_positions} positions")
        out.append(ids)
    return out


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: list[list[int]], *, top_k: int = 0, pad_id: int = 0,
                    token_budget: int = 8192) -> list[tuple[PromptLogprobs, tuple[int, ...]]]:
    """Score `sequences` (already checked) with `model` in its current mode, in right-padded batches of at
    most `token_budget` padded tokens (one sequence longer than that goes alone). With each score, the rank
    of each scored token in its position's distribution (1: the most likely), as vLLM reports it."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[tuple[PromptLogprobs, tuple[int, ...]] | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and len(sequences[order[end]]) * (end + 1 - start) <= token_budget:
            end += 1
        chunk = [sequences[i] for i in order[start:end]]
        for i, scored in zip(order[start:end], _score_batch(model, chunk, top_k, pad_id, device), strict=True):
            out[i] = scored
        start = end
    return out  # type: ignore[return-value]


def _score_batch(model, seqs: list[list[int]], top_k: int, pad_id: int,
                 device) -> list[tuple[PromptLogprobs, tuple[int, ...]]]:
    width = max(len(s) for s in seqs)
    ids_B_T = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask_B_T = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_B_T[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask_B_T[b, : len(s)] = 1
    ids_B_T, mask_B_T = ids_B_T.to(device), mask_B_T.to(device)
    pos_B_T = torch.arange(width, device=device).expand(len(seqs), width)
    logits_B_T_V = model(input_ids=ids_B_T, attention_mask=None if bool(mask_B_T.all()) else mask_B_T,
                         position_ids=pos_B_T, use_cache=False).logits
    logits = logits_B_T_V[:, :-1, :].float()
    lse_B_T = torch.logsumexp(logits, dim=-1)
    target_B_T = logits.gather(-1, ids_B_T[:, 1:].unsqueeze(-1)).squeeze(-1)
    picked_B_T = target_B_T - lse_B_T
    ranks = ((logits > target_B_T.unsqueeze(-1)).sum(-1) + 1).cpu().tolist()
    top = None
    if top_k:
        values, indices = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
        top = ((values - lse_B_T.unsqueeze(-1)).cpu().tolist(), indices.cpu().tolist())
    picked = picked_B_T.cpu().tolist()
    out = []
    for b, s in enumerate(seqs):
        n = len(s) - 1
        tops = None
        if top is not None:
            tops = tuple(dict(zip(top[1][b][t], top[0][b][t], strict=True)) for t in range(n))
        out.append((PromptLogprobs(tuple(picked[b][:n]), tops), tuple(ranks[b][:n])))
    return out
