"""Several vision-language requests decoded together (what `tokenmill serve` does with the requests waiting
for a Qwen2-VL-family model).

Each request is prefilled on its own, as `VisionEngine` does: its images go through the vision encoder once
and its `n` samples continue from copies of its one cache. The caches are then left-padded to the longest
prompt and stacked, so every decoding step is one forward over all the requests' live rows, an attention mask
hiding the padding and each row keeping its own multimodal position. Each request samples its rows with its
own parameters and random generator, the same calls in the same order as alone, so a seeded request draws the
tokens it draws alone; the logprobs equal the one-at-a-time ones to float rounding (the padded attention sums
the same terms in another order; 1e-6 on the tiny models).

    >>> groups = decode_together(engine, [VisionRequest(ids, params, inputs)])           # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from tokenmill.engines.local.sampling import sample_tokens
from tokenmill.engines.local.vision import VisionEngine, text_config
from tokenmill.types import Completion, ImageInputs, SamplingParams, StopReason


@dataclass
class VisionRequest:
    """One prompt, its images (None: text only), its sampling parameters and its generator (None: the
    engine's)."""

    prompt: list[int]
    params: SamplingParams
    images: ImageInputs | None = None
    generator: torch.Generator | None = None


def stack_caches(caches: list[DynamicCache], lengths: list[int], config) -> DynamicCache:
    """One cache of the rows of `caches` (in order), each left-padded with zeros to the longest length."""
    longest = max(lengths)
    out = DynamicCache(config=config)
    for layer in range(len(caches[0].layers)):
        keys, values = [], []
        for cache, length in zip(caches, lengths, strict=True):
            pad = (0, 0, longest - length, 0)  # [B, heads, length, head_dim]: pad the length on the left
            keys.append(torch.nn.functional.pad(cache.layers[layer].keys, pad))
            values.append(torch.nn.functional.pad(cache.layers[layer].values, pad))
        out.update(torch.cat(keys), torch.cat(values), layer)
    return out


class _Rows:
    """The decoding state of the live rows: which request and sample each is, and what each has drawn."""

    def __init__(self, engine: VisionEngine, requests: list[VisionRequest]) -> None:
        self.engine, self.requests = engine, requests
        self.owner = [(r, i) for r, q in enumerate(requests) for i in range(q.params.n)]  # live row -> (request, i)
        self.tokens = [[[] for _ in range(q.params.n)] for q in requests]
        self.logps = [[[] for _ in range(q.params.n)] for q in requests]
        self.reasons: list[list[StopReason | None]] = [[None] * q.params.n for q in requests]
        limit = engine.max_positions
        self.max_tokens = [max(1, min(q.params.max_tokens, limit - len(q.prompt))) if limit else q.params.max_tokens
                           for q in requests]

    def sample(self, logits_B_V: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """Each request samples its live rows; (the tokens, the rows that go on after `step`)."""
        tok_B = torch.empty(len(self.owner), dtype=torch.long, device=logits_B_V.device)
        keep = []
        for r, q in enumerate(self.requests):
            rows = [b for b, (owner, _) in enumerate(self.owner) if owner == r]
            if not rows:
                continue
            generator = q.generator if q.generator is not None else self.engine.generator
            toks, logps = sample_tokens(logits_B_V[rows], q.params, generator)
            tok_B[rows] = toks
            for b, t, lp in zip(rows, toks.tolist(), logps.tolist(), strict=True):
                i = self.owner[b][1]
                self.tokens[r][i].append(t)
                self.logps[r][i].append(lp)
                if t in self.engine.eos_ids or self.engine._hit_stop(self.tokens[r][i], q.params.stop):
                    self.reasons[r][i] = StopReason.STOP
                elif step < self.max_tokens[r] - 1:
                    keep.append(b)
        return tok_B, sorted(keep)

    def completions(self) -> list[list[Completion]]:
        out = []
        for r, q in enumerate(self.requests):
            texts = self.engine.tokenizer.batch_decode(self.tokens[r], skip_special_tokens=True)
            out.append([self.engine._completion(self.tokens[r][i], self.logps[r][i], self.reasons[r][i], texts[i],
                                                q.params.stop) for i in range(q.params.n)])
        return out


def decode_together(engine: VisionEngine, requests: list[VisionRequest]) -> list[list[Completion]]:
    """Each request's `params.n` completions, the requests decoded as one batch (see the module's doc)."""
    was_training = engine.model.training
    engine.model.eval()
    try:
        with torch.inference_mode(), engine._autocast():
            return _decode(engine, requests)
    finally:
        engine.model.train(was_training)


def _decode(engine: VisionEngine, requests: list[VisionRequest]) -> list[list[Completion]]:
    prefills = [engine._prefill(list(q.prompt), q.images, q.params.n) for q in requests]
    lengths = [len(q.prompt) for q in requests]
    cache = stack_caches([c for _, c, _ in prefills], lengths, text_config(engine.model.config))
    device = engine.device
    longest = max(lengths)
    rows_len = torch.tensor([length for q, length in zip(requests, lengths, strict=True) for _ in range(q.params.n)],
                            device=device)
    mask_B_S = (torch.arange(longest, device=device)[None, :] >= (longest - rows_len)[:, None]).long()
    next_pos_B = torch.tensor([pos for q, (_, _, pos) in zip(requests, prefills, strict=True)
                               for _ in range(q.params.n)], dtype=torch.long, device=device)
    logits_B_V = torch.cat([logits for logits, _, _ in prefills])
    state = _Rows(engine, requests)
    for step in range(max(state.max_tokens)):
        tok_B, keep = state.sample(logits_B_V, step)
        if not keep:
            break
        if len(keep) < len(state.owner):
            keep_t = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_t)
            tok_B, mask_B_S, next_pos_B = tok_B[keep_t], mask_B_S[keep_t], next_pos_B[keep_t]
            state.owner = [state.owner[b] for b in keep]
        mask_B_S = torch.cat([mask_B_S, torch.ones_like(mask_B_S[:, :1])], dim=1)
        pos_3_B_1 = (next_pos_B + step)[None, :, None].expand(3, -1, -1)
        out = engine.model(input_ids=tok_B[:, None], position_ids=pos_3_B_1, attention_mask=mask_B_S, use_cache=True,
                           **{engine._cache_keyword: cache})
        logits_B_V = out.logits[:, -1, :]
    return state.completions()

