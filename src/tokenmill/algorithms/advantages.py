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
    A_i = r_i - mean(r). A group with fewer than two valid samples gets zeros. Works on `[..., G]`: every
    leading index is its own group.
    """
    valid = ~torch.isnan(rewards_G)
    count = valid.sum(-1, keepdim=True)
    r = torch.where(valid, rewards_G, torch.zeros_like(rewards_G))
    mean = r.sum(-1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    if scale_rewards:
        std = ((centred**2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    return torch.where(count >= 2, centred, torch.zeros_like(centred))


@register_advantage("rloo")
def rloo_advantages(rewards_G: torch.Tensor, **_: object) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)).

    NaN rewards are left out (advantage 0); works on `[..., G]` like `grpo_advantages`."""
    valid = ~torch.isnan(rewards_G)
    count = valid.sum(-1, keepdim=True)
    r = torch.where(valid, rewards_G, torch.zeros_like(rewards_G))
    others = (r.sum(-1, keepdim=True) - r) / (count - 1).clamp(min=1)
    return torch.where(valid & (count >= 2), r - others, torch.zeros_like(r))


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards_G: torch.Tensor, eps: float = 1e-4, **_: object) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu et al. 2025): subtract each group's mean, then normalise by the
    mean and unbiased std of those centred rewards over the *whole batch* (every valid sample of every
    group), not per group, which keeps small groups from inflating their advantages. Expects all groups
    at once, `[N, G]` (NaN = missing)."""
    valid = ~torch.isnan(rewards_G)
    count = valid.sum(-1, keepdim=True)
    r = torch.where(valid, rewards_G, torch.zeros_like(rewards_G))
    centred = torch.where(valid, r - r.sum(-1, keepdim=True) / count.clamp(min=1), torch.zeros_like(r))
    n = int(valid.sum())
    if n < 2:
        return torch.zeros_like(r)
    mean = centred[valid].mean()
    std = centred[valid].std(unbiased=True)
    return torch.where(valid, (centred - mean) / (std + eps), torch.zeros_like(r))


def episode_columns(group: Group) -> tuple[list[float], list[int]]:
    """The group's rewards as an estimator sees them, and the column of each sample: one column per sample, but
    one per episode for the model calls of a step-wise episode (`Sample.episode`), which share its return; so
    a long episode counts once in the group's mean and std, not once per call."""
    columns: dict[object, int] = {}
    rewards, index = [], []
    for k, s in enumerate(group.samples):
        key = ("episode", s.episode) if s.episode >= 0 else ("sample", k)
        if key not in columns:
            columns[key] = len(rewards)
            rewards.append(s.reward)
        index.append(columns[key])
    return rewards, index


def assign_advantages(groups: list[Group], name: str, **kwargs: object) -> list[Group]:
    """Apply the estimator `name` to all groups at once, as one `[N, G]` tensor (NaN-padded where groups
    differ in size; NaN is "left out" for every estimator); return groups whose samples carry `advantage`.
    A step-wise episode's calls are one column (`episode_columns`) and each gets the episode's advantage."""
    if not groups:
        return []
    fn = ADVANTAGES[name]
    columns = [episode_columns(g) for g in groups]
    width = max(len(rewards) for rewards, _ in columns)
    rewards_N_G = torch.full((len(groups), width), float("nan"), dtype=torch.float64)
    for i, (rewards, _) in enumerate(columns):
        rewards_N_G[i, : len(rewards)] = torch.tensor(rewards, dtype=torch.float64)
    adv_N_G = fn(rewards_N_G, **kwargs).tolist()
    return [
        Group(g.group_id, tuple(s.with_(advantage=adv[c]) for s, c in zip(g.samples, index, strict=True)))
        for g, adv, (_, index) in zip(groups, adv_N_G, columns, strict=True)
    ]
