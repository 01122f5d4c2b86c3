"""Scored samples without a model, for trainer tests: groups sharing a prompt, of uneven sizes and lengths."""

from __future__ import annotations

import random

from tokenmill.types import Sample, StopReason


def uneven_groups(step: int, vocab: int, shapes: tuple[tuple[int, int, int], ...]) -> list[Sample]:
    """One group per `(prompt_len, count, longest)`: `count` answers of 1..`longest` random tokens to one
    random prompt, with random sampler logprobs and advantages, seeded by `step` (token ids from 3 up, clear
    of the special tokens). Uneven shapes make whole-group splits across ranks uneven."""
    rng = random.Random(100 + step)
    out = []
    for prompt_len, count, longest in shapes:
        prompt = [rng.randint(3, vocab - 1) for _ in range(prompt_len)]
        for _ in range(count):
            completion = [rng.randint(3, vocab - 1) for _ in range(rng.randint(1, longest))]
            out.append(Sample(
                tokens=tuple(prompt + completion), loss_mask=(0,) * prompt_len + (1,) * len(completion),
                logprobs=(0.0,) * prompt_len + tuple(-rng.uniform(1.0, 4.0) for _ in completion),
                prompt_len=prompt_len, prompt="p", completion="c", stop_reason=StopReason.STOP,
                advantage=rng.uniform(-1.5, 1.5),
            ))
    return out
