"""Advantage estimators: pure functions from a group's rewards to one advantage per sample.

Each takes `rewards_G` (a 1-D float tensor, one reward per sample of a group; NaN marks a sample whose
rewards all failed: it gets advantage 0 and is left out of the group's statistics) and returns `adv_G`.
Register new ones with `@register_advantage("name")`; `algorithm.advantage` picks one by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.types import Group

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def add(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES[name] = fn
        return fn

    return add


@register_advantage("grpo")
def grpo_advantages(rewards_G: torch.Tensor, scale_rewards: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean(r)) / (std(r) + eps).

    std is the unbiased sample std, as in TRL. `scale_rewards=False` gives Dr.GRPO (Liu et al. 2025):
    A_i = r_i - mean(r). A group with one valid sample gets zeros.
    """
    valid_G = ~torch.isnan(rewards_G)
    adv_G = torch.zeros_like(rewards_G)
    if valid_G.sum() < 2:
        return adv_G
    r = rewards_G[valid_G]
    centred = r - r.mean()
    adv_G[valid_G] = centred / (r.std(unbiased=True) + eps) if scale_rewards else centred
    return adv_G


@register_advantage("rloo")
def rloo_advantages(rewards_G: torch.Tensor, **_: object) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))."""
    valid_G = ~torch.isnan(rewards_G)
    adv_G = torch.zeros_like(rewards_G)
    g = int(valid_G.sum())
    if g < 2:
        return adv_G
    r = rewards_G[valid_G]
    adv_G[valid_G] = r - (r.sum() - r) / (g - 1)
    return adv_G


def assign_advantages(groups: list[Group], name: str, **kwargs: object) -> list[Group]:
    """Apply the estimator `name` inside every group; return groups whose samples carry `advantage`."""
    fn = ADVANTAGES[name]
    out = []
    for g in groups:
        adv_G = fn(torch.tensor(g.rewards_G, dtype=torch.float64), **kwargs).tolist()
        out.append(Group(g.group_id, tuple(s.with_(advantage=a) for s, a in zip(g.samples, adv_G, strict=True))))
    return out
