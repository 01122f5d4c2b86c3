"""Reward shaping applied by the trainer after the user's rewards (pure functions on numbers)."""

from __future__ import annotations

import math

from tokenmill.types import Group, StopReason


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0, truncated: bool = False) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025), for a response of `length` tokens:

        0                                                     if length <= max_tokens - buffer
        factor * ((max_tokens - buffer) - length) / buffer    inside the last `buffer` tokens
        -factor                                               if truncated (it hit max_tokens unfinished)

    so long answers lose reward gradually instead of a cliff at the truncation point.
    """
    if buffer <= 0:
        return 0.0
    if truncated:
        return -factor
    start = max_tokens - buffer
    return 0.0 if length <= start else factor * (start - min(length, max_tokens)) / buffer


def has_spread(group: Group) -> bool:
    """Whether a group's valid rewards differ (a group with one reward value teaches GRPO nothing)."""
    valid = {s.reward for s in group.samples if not math.isnan(s.reward)}
    return len(valid) > 1


def shape_overlong(groups: list[Group], max_tokens: int, buffer: int, factor: float) -> list[Group]:
    """Add `overlong_penalty` to every sample's reward; it is also logged as the reward `overlong`."""
    if buffer <= 0:
        return groups
    out = []
    for g in groups:
        samples = []
        for s in g.samples:
            p = overlong_penalty(s.completion_len, max_tokens, buffer, factor, s.stop_reason is StopReason.LENGTH)
            samples.append(s.with_(reward=s.reward + p, rewards={**s.rewards, "overlong": p}))
        out.append(Group(g.group_id, tuple(samples)))
    return out
