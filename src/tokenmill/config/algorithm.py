"""The algorithm's section (`algorithm:`: advantages, loss, off-policy correction) and the critic's (`critic:`).

Part of the configuration tree in `config.schema`, which re-exports both classes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokenmill.config.section import LoRAConfig, Section

GROUP_BASELINES = ("grpo", "rloo", "reinforce_pp")  # advantages measured against the prompt's other completions


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae", "distill"] = Field(
        "grpo", description="Advantage estimator: grpo (group mean/std), rloo (leave-one-out mean), "
        "reinforce_pp (group mean, then batch-wide mean/std normalisation), gae (PPO: a critic's values and "
        "generalised advantage estimation per token; configure `critic`), distill (minus the reverse KL to a "
        "teacher per token; configure `distillation`)."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount per policy token (PPO).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda: bias (0) vs variance (1) (PPO).")
    whiten_advantages: bool = Field(
        True, description="GAE: normalise the batch's token advantages to mean 0, std 1 (PPO)."
    )
    kl_in_reward: bool = Field(
        False, description="GAE: subtract kl_coef x (logp - logp_ref) from each token's reward (classic RLHF "
        "PPO) instead of adding the KL penalty to the loss (GRPO's way)."
    )
    scale_rewards: bool = Field(
        True, description="GRPO: divide by the group's reward std (False = Dr.GRPO)."
    )
    loss: Literal["ppo_clip", "gspo", "cispo"] = Field(
        "ppo_clip", description="Policy loss: ppo_clip (token ratio clipped), gspo (sequence ratio clipped; "
        "use loss_agg sequence_mean and clip ranges ~3e-4/4e-4), cispo (clipped importance weight times logp)."
    )
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip range below 1 (ratio >= 1 - clip_low).")
    clip_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO clip range above 1 (DAPO raises it).")
    loss_agg: Literal["token_mean", "sequence_mean", "token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: mean over all completion tokens; sequence_mean: mean per sequence, then "
        "over sequences; token_sum_norm: token sum / (sequences x max_tokens) (Dr.GRPO).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL penalty to the frozen reference model.")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator (Schulman's k1 or k3).")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Entropy bonus: the loss minus this times the (aggregated) token entropy."
    )
    ppo_epochs: int = Field(1, ge=1, description="Optimiser passes over each rollout batch.")
    mini_batches: int = Field(1, ge=1, description="Optimiser steps per pass (the batch is split in this many).")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal and sample more "
        "prompts to refill the step, for at most max_sampling_rounds generation rounds."
    )
    max_sampling_rounds: int = Field(3, ge=1, description="Generation rounds per step with dynamic_sampling.")
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: responses in the last N tokens before "
        "generation.max_tokens lose up to overlong_penalty reward linearly; truncated ones lose all of it (0 = off)."
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Largest overlong punishment (see overlong_buffer).")
    skip_zero_advantage: bool = Field(
        True,
        description="Do not run forward/backward on samples whose advantage is 0 (identical gradient when "
        "kl_coef is 0; their tokens still count in the loss normaliser).",
    )
    off_policy: Literal["none", "tis", "mis", "seq_tis", "seq_mis", "decoupled", "icepop", "binary_kl"] = Field(
        "none", description="Correction for samples the trainer would not have drawn (stale in async training, "
        "or an engine that differs from the trainer): none (PPO ratio against the sampler's logprobs); the others "
        "clip against the trainer's recomputed logprobs and weigh each token by w = pi_trainer / pi_sampler: "
        "tis min(w, is_cap); mis w, tokens outside [1/is_cap, is_cap] dropped; seq_tis / seq_mis the same with "
        "one ratio per sequence (the product of its tokens'); decoupled (AReaL) w, tokens above is_cap dropped; "
        "icepop w, tokens outside [mask_low, mask_high] dropped; binary_kl w, tokens whose binary KL between "
        "sampler and trainer exceeds mask_kl dropped. "
        "Each costs one extra no-grad forward per step (docs/health.md)."
    )
    is_cap: float = Field(
        2.0, ge=1.0, description="Cap C of the behaviour importance weight (algorithm.off_policy other than none)."
    )
    mask_low: float = Field(
        0.5, gt=0.0, le=1.0, description="off_policy icepop: tokens whose w = pi_trainer / pi_sampler is below "
        "this are dropped from the loss."
    )
    mask_high: float = Field(
        5.0, ge=1.0, description="off_policy icepop: tokens whose w = pi_trainer / pi_sampler is above this are "
        "dropped from the loss."
    )
    mask_kl: float = Field(
        0.05, gt=0.0, description="off_policy binary_kl: tokens whose KL(Bernoulli(p_sampler) || "
        "Bernoulli(p_trainer)) of the sampled token exceeds this are dropped from the loss."
    )


class CriticConfig(Section):
    """The value model of PPO (`algorithm.advantage: gae`): a one-label token classifier (a transformer with a
    scalar head), trained on the GAE returns by its own optimiser."""

    path: str | None = Field(
        None, description="Folder of the critic; default: the policy's weights with a fresh, zeroed value head."
    )
    learning_rate: float = Field(1e-4, gt=0.0, le=1.0, description="Critic AdamW learning rate.")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="Clip the new value to old +- this in the value loss (None = plain MSE)."
    )
    warmup_steps: int = Field(
        0, ge=0, description="RL steps at the start that train only the critic (the policy waits for useful values)."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Clip the critic's gradient norm to this.")
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="Low-rank adapters (peft) for the critic: only they and the value head train; off when rank is 0.",
    )
