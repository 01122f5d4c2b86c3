"""Offline preference and reward-model losses on sequence log-probabilities (pure functions).

Inputs are per pair (shape `[P]`): the policy's summed log-probability of the chosen and the rejected
completion, the frozen reference's where the loss needs one, and completion lengths for SimPO. Each
returns (mean loss, metrics) with the implicit reward margin and the share of pairs ranked right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _metrics(margin_P: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"margin": margin_P.mean(), "accuracy": (margin_P > 0).float().mean()}


def dpo_loss(
    chosen_P: torch.Tensor, rejected_P: torch.Tensor, ref_chosen_P: torch.Tensor, ref_rejected_P: torch.Tensor,
    beta: float = 0.1, label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * h), h = (pi_c - ref_c) - (pi_r - ref_r).

    `label_smoothing` = e assumes labels flip with probability e (conservative DPO)."""
    h_P = (chosen_P - ref_chosen_P) - (rejected_P - ref_rejected_P)
    logits_P = beta * h_P
    loss_P = -(1 - label_smoothing) * F.logsigmoid(logits_P) - label_smoothing * F.logsigmoid(-logits_P)
    return loss_P.mean(), _metrics(logits_P)


def ipo_loss(
    chosen_P: torch.Tensor, rejected_P: torch.Tensor, ref_chosen_P: torch.Tensor, ref_rejected_P: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IPO (Azar et al. 2023): (h - 1 / (2 beta))^2, h as in DPO: regresses the margin to a fixed target
    instead of pushing it to infinity."""
    h_P = (chosen_P - ref_chosen_P) - (rejected_P - ref_rejected_P)
    return ((h_P - 1.0 / (2.0 * beta)) ** 2).mean(), _metrics(h_P)


def simpo_loss(
    chosen_P: torch.Tensor, rejected_P: torch.Tensor, chosen_len_P: torch.Tensor, rejected_len_P: torch.Tensor,
    beta: float = 2.0, gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (Meng et al. 2024): -log sigmoid(beta * (pi_c / |y_c| - pi_r / |y_r|) - gamma); no reference
    model, length-normalised log-probabilities, a target margin gamma."""
    logits_P = beta * (chosen_P / chosen_len_P - rejected_P / rejected_len_P) - gamma
    return -F.logsigmoid(logits_P).mean(), _metrics(logits_P)


def bradley_terry_loss(
    chosen_score_P: torch.Tensor, rejected_score_P: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model training (Bradley & Terry 1952; Ouyang et al. 2022): -log sigmoid(s_c - s_r)."""
    margin_P = chosen_score_P - rejected_score_P
    return -F.logsigmoid(margin_P).mean(), _metrics(margin_P)
