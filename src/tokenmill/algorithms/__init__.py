"""Algorithm-specific math as registered pure functions; the trainer never branches on algorithm names."""

from tokenmill.algorithms.advantages import (
    ADVANTAGES,
    assign_advantages,
    grpo_advantages,
    register_advantage,
    reinforce_pp_advantages,
    rloo_advantages,
)
from tokenmill.algorithms.aggregation import token_weights
from tokenmill.algorithms.losses import (
    LOSSES,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    register_loss,
    sft_loss,
)

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "assign_advantages",
    "cispo_loss",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "ppo_clip_loss",
    "register_advantage",
    "register_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sft_loss",
    "token_weights",
]
