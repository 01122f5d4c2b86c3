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
        with torch.no_grad():
            metrics["vf_clip_fraction"] = ((clipped_error_B_T > error_B_T).float() * weights_B_T).sum()
        error_B_T = torch.maximum(error_B_T, clipped_error_B_T)
    return 0.5 * (error_B_T * weights_B_T).sum(), metrics
