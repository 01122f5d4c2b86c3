"""PPO-with-a-critic math: generalised advantage estimation and the clipped value loss (pure functions).

Shapes: B sequences, T tokens; `mask_B_T` is 1 on the tokens the policy produced (the ones that get an
advantage), 0 on prompt, environment and padding tokens. Masked tokens are skipped, so a multi-turn
trajectory's policy tokens form one chain across the environment's turns.
"""

from __future__ import annotations

import torch


def gae(
    rewards_B_T: torch.Tensor,
    values_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns (advantages, returns).

    delta_t = r_t + gamma * V_next - V_t        (V_next = 0 after the last policy token)
    A_t     = delta_t + gamma * lam * A_next
    R_t     = A_t + V_t                         (the critic's regression target)
    Both are 0 on masked tokens.
    """
    adv_B_T = torch.zeros_like(values_B_T)
    last_adv_B = torch.zeros_like(values_B_T[:, 0])
    next_value_B = torch.zeros_like(values_B_T[:, 0])
    mask_B_T = mask_B_T.to(values_B_T.dtype)
    for t in range(values_B_T.shape[1] - 1, -1, -1):
        m_B = mask_B_T[:, t]
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        adv_t_B = delta_B + gamma * lam * last_adv_B
        adv_B_T[:, t] = adv_t_B * m_B
        # a masked token leaves the chain untouched: the next policy token looks past it
        last_adv_B = torch.where(m_B > 0, adv_t_B, last_adv_B)
        next_value_B = torch.where(m_B > 0, values_B_T[:, t], next_value_B)
    return adv_B_T, (adv_B_T + values_B_T) * mask_B_T


def value_loss(
    values_B_T: torch.Tensor,
    old_values_B_T: torch.Tensor,
    returns_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), weighted.

    `clip=None` gives the plain squared error. Returns the loss and the clipped share of tokens.
    """
    error_B_T = (values_B_T - returns_B_T) ** 2
    metrics: dict[str, torch.Tensor] = {}
    if clip is not None:
        clipped_B_T = old_values_B_T + torch.clamp(values_B_T - old_values_B_T, -clip, clip)
        clipped_error_B_T = (clipped_B_T - returns_B_T) ** 2
        # inside the clip range V_old + (V - V_old) can round above V: only a value that really moved more
        # than `clip` takes the clipped branch (else that token would lose its gradient to float noise)
        clipped_wins_B_T = ((values_B_T - old_values_B_T).abs() > clip) & (clipped_error_B_T > error_B_T)
        with torch.no_grad():
            metrics["vf_clip_fraction"] = (clipped_wins_B_T.float() * weights_B_T).sum()
        error_B_T = torch.where(clipped_wins_B_T, clipped_error_B_T, error_B_T)
    return 0.5 * (error_B_T * weights_B_T).sum(), metrics


def token_rewards(
    scores_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    logprobs_B_T: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards for GAE: the sequence's score on its last policy token, and with KL-in-reward (the
    classic RLHF PPO of Ziegler et al. 2019 / Ouyang et al. 2022) a penalty on every policy token:

    r_t = -kl_coef * (logp_t - logp_ref_t) + [t is the last policy token] * score
    """
    mask = mask_B_T.to(torch.float32)
    positions_B_T = torch.arange(mask.shape[1]).expand_as(mask)
    last_B = torch.where(mask > 0, positions_B_T, -1).max(dim=1).values
    rewards_B_T = torch.zeros_like(mask)
    has_token_B = last_B >= 0
    rows_B = torch.arange(mask.shape[0])[has_token_B]
    rewards_B_T[rows_B, last_B[has_token_B]] = scores_B[has_token_B].to(torch.float32)
    if kl_coef and ref_logprobs_B_T is not None and logprobs_B_T is not None:
        rewards_B_T = rewards_B_T - kl_coef * (logprobs_B_T - ref_logprobs_B_T) * mask
    return rewards_B_T


def whiten(values_B_T: torch.Tensor, mask_B_T: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked tokens of the whole batch; 0 on masked-out tokens."""
    mask = mask_B_T.to(values_B_T.dtype)
    n = mask.sum().clamp(min=1.0)
    mean = (values_B_T * mask).sum() / n
    var = (((values_B_T - mean) * mask) ** 2).sum() / n
    return (values_B_T - mean) * torch.rsqrt(var + eps) * mask


def explained_variance(values_B_T: torch.Tensor, returns_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over the masked tokens: 1 is a perfect critic, 0 no better than a constant."""
    mask = mask_B_T.to(values_B_T.dtype)
    n = mask.sum().clamp(min=1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / n
        return (((x - mean) * mask) ** 2).sum() / n

    total = var(returns_B_T)
    return float(1.0 - var(returns_B_T - values_B_T) / total) if total > 0 else 0.0
