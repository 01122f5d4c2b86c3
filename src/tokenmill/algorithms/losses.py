"""Policy losses and KL estimators: pure tensor functions, registered by name.

Shapes: B sequences, T tokens. Every per-token tensor is aligned with the tokens: position t holds
log p(token_t | tokens_<t). `weights_B_T` carries both the loss mask and the aggregation: it is 0 on prompt,
environment and padding tokens, and the weights of a whole mini-batch sum to 1 (see
`algorithms.aggregation`). Advantages come per sequence (`[B]`, the GRPO family) or per token (`[B, T]`, PPO
with GAE); `_per_token` lines both up with the tokens. So a loss is `sum(per_token_loss * weights)`, gradients add up exactly across
micro-batches, and a weighted sum of any per-token metric is that metric's mini-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return add


def kl_penalty(
    logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor, estimator: Literal["k1", "k3"]
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL", 2020).

    k1 = log pi - log pi_ref                      (unbiased, can be negative)
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1   (unbiased, always >= 0)
    """
    log_ratio_B_T = ref_logprobs_B_T - logprobs_B_T
    if estimator == "k1":
        return -log_ratio_B_T
    if estimator == "k3":
        # clamp as verl does: exp() of a large log-ratio from a stale token would overflow
        log_ratio_B_T = log_ratio_B_T.clamp(-20.0, 20.0)
        return torch.exp(log_ratio_B_T) - log_ratio_B_T - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


@register_loss("ppo_clip")
def ppo_clip_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages: torch.Tensor,
    weights_B_T: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (Schulman et al. 2017) with an optional KL penalty (GRPO puts it in the loss).

    ratio_t = exp(logp_t - logp_old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A) + kl_coef * KL_t
    loss    = sum_t loss_t * w_t
    Returns the loss and weighted metrics (clip fraction, KL, ratio), each summed with the same weights.
    """
    adv = _per_token(advantages)
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    unclipped_B_T = ratio_B_T * adv
    clipped_B_T = torch.clamp(ratio_B_T, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token_B_T = -torch.minimum(unclipped_B_T, clipped_B_T)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        metrics["clip_fraction"] = ((clipped_B_T < unclipped_B_T).float() * weights_B_T).sum()
        metrics["ratio_mean"] = (ratio_B_T * weights_B_T).sum()
    return _finish(per_token_B_T, logprobs_B_T, weights_B_T, metrics, ref_logprobs_B_T, kl_coef, kl_estimator)


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """`[B]` -> `[B, 1]` (broadcast over tokens); `[B, T]` stays as it is."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def _finish(
    per_token_B_T: torch.Tensor,
    logprobs_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    ref_logprobs_B_T: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: Literal["k1", "k3"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the KL penalty (and its metric) where a reference is given; reduce with the weights."""
    with torch.no_grad():
        metrics["policy_loss"] = (per_token_B_T * weights_B_T).sum()
    if ref_logprobs_B_T is not None:
        kl_B_T = kl_penalty(logprobs_B_T, ref_logprobs_B_T, kl_estimator)
        metrics["kl"] = (kl_B_T.detach() * weights_B_T).sum()
        if kl_coef:
            per_token_B_T = per_token_B_T + kl_coef * kl_B_T
    return (per_token_B_T * weights_B_T).sum(), metrics


def _sequence_mean(values_B_T: torch.Tensor, weights_B_T: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each sequence's trained tokens (those with a non-zero weight): `[B, 1]`."""
    mask_B_T = (weights_B_T != 0).to(values_B_T.dtype)
    return (values_B_T * mask_B_T).sum(-1, keepdim=True) / mask_B_T.sum(-1, keepdim=True).clamp(min=1.0)


@register_loss("gspo")
def gspo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages: torch.Tensor,
    weights_B_T: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    ref_logprobs_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the clip acts on a sequence ratio.

    s_i    = exp(mean_t (logp_t - logp_old_t))        over sequence i's trained tokens
    loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)
    Every trained token of sequence i carries loss_i, so with `loss_agg: sequence_mean` the loss is the
    paper's mean over sequences (token_mean weights sequences by length). The paper's clip ranges are tiny
    (3e-4 / 4e-4) because a sequence ratio moves far less than a token ratio.
    """
    if advantages.dim() != 1:
        raise ValueError("gspo needs one advantage per sequence (it clips a sequence ratio)")
    adv_B_1 = advantages[:, None]
    seq_ratio_B_1 = torch.exp(_sequence_mean(logprobs_B_T - old_logprobs_B_T, weights_B_T))
    unclipped_B_1 = seq_ratio_B_1 * adv_B_1
    clipped_B_1 = torch.clamp(seq_ratio_B_1, 1.0 - clip_low, 1.0 + clip_high) * adv_B_1
    per_token_B_T = (-torch.minimum(unclipped_B_1, clipped_B_1)).expand_as(logprobs_B_T)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        clipped_B_T = (clipped_B_1 < unclipped_B_1).float().expand_as(weights_B_T)
        metrics["clip_fraction"] = (clipped_B_T * weights_B_T).sum()
        metrics["ratio_mean"] = (seq_ratio_B_1.expand_as(weights_B_T) * weights_B_T).sum()
    return _finish(per_token_B_T, logprobs_B_T, weights_B_T, metrics, ref_logprobs_B_T, kl_coef, kl_estimator)


@register_loss("cispo")
def cispo_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages: torch.Tensor,
    weights_B_T: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs_B_T: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, never the gradient.

    loss_t = -sg(clip(ratio_t, 1 - clip_low, 1 + clip_high)) * A * logp_t
    Unlike PPO-clip, a token whose ratio left the range still gets a (bounded) gradient, so rare
    high-ratio tokens keep contributing.
    """
    ratio_B_T = torch.exp(logprobs_B_T - old_logprobs_B_T)
    weight_B_T = torch.clamp(ratio_B_T, 1.0 - clip_low, 1.0 + clip_high).detach()
    per_token_B_T = -weight_B_T * _per_token(advantages) * logprobs_B_T
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        outside_B_T = ((ratio_B_T < 1.0 - clip_low) | (ratio_B_T > 1.0 + clip_high)).float()
        metrics["clip_fraction"] = (outside_B_T * weights_B_T).sum()
        metrics["ratio_mean"] = (ratio_B_T * weights_B_T).sum()
    return _finish(per_token_B_T, logprobs_B_T, weights_B_T, metrics, ref_logprobs_B_T, kl_coef, kl_estimator)


@register_loss("sft")
def sft_loss(
    logprobs_B_T: torch.Tensor, weights_B_T: torch.Tensor, **_: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the weighted tokens: loss = -sum_t w_t * logp_t."""
    nll = -(logprobs_B_T * weights_B_T).sum()
    return nll, {"nll": nll.detach()}


# ------------------------------------------------------------------------------------ off-policy correction
OFF_POLICY = ("tis", "mis", "seq_tis", "seq_mis", "decoupled", "icepop", "binary_kl")


def binary_kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)) of each token, from its logprob under p and under q.

    D = p log(p / q) + (1 - p) log((1 - p) / (1 - q)): the divergence of the two policies restricted to the
    one question "this token or another one?". Unlike the log-ratio it is small for a rare token whose tiny
    probability moved by a large factor, and large for a likely token whose probability moved a lot.
    Computed in float64; 0 where p == q, +inf where q is 1 and p is not.
    """
    lp, lq = p_logprobs.double(), q_logprobs.double()
    p, not_p, not_q = torch.exp(lp), -torch.expm1(lp), -torch.expm1(lq)
    return p * (lp - lq) + torch.xlogy(not_p, not_p) - torch.xlogy(not_p, not_q)


def behaviour_weights(
    prox_logprobs_B_T: torch.Tensor, behaviour_logprobs_B_T: torch.Tensor, mode: str, cap: float,
    mask_B_T: torch.Tensor | None = None, ratio_band: tuple[float, float] = (0.5, 5.0), kl_band: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weight from the behaviour policy (the sampler that produced the tokens, possibly
    several versions old, possibly another precision or kernel) to the proximal policy (the trainer's weights
    before this update, recomputed).

    w_t = exp(logp_prox_t - logp_behaviour_t);  W = exp(sum_t mask_t (logp_prox_t - logp_behaviour_t)) per row
    tis:        min(w_t, C)                       (truncated: a token counts at most C times)
    mis:        w_t if 1/C <= w_t <= C else 0     (masked: tokens the two policies disagree on are dropped)
    seq_tis:    min(W, C) on every token of the row
    seq_mis:    W if 1/C <= W <= C else 0 on every token of the row (the whole sequence dropped)
    decoupled:  w_t if w_t <= C else 0            (AReaL's `behav_imp_weight_cap`: such tokens are dropped)
    icepop:     w_t if low <= w_t <= high else 0  (a ratio band of its own, `ratio_band = (low, high)`)
    binary_kl:  w_t if binary_kl(behaviour_t, prox_t) <= kl_band else 0   (a band on the binary KL)
    mask_B_T marks the trained tokens a sequence ratio is taken over (default: all). Returns (the weight to
    apply, detached; the raw w_t, or W for the sequence modes, detached).
    """
    log_w_B_T = (prox_logprobs_B_T - behaviour_logprobs_B_T).detach()
    if mode in ("seq_tis", "seq_mis"):
        mask_B_T = torch.ones_like(log_w_B_T) if mask_B_T is None else mask_B_T.to(log_w_B_T.dtype)
        raw_B_T = torch.exp((log_w_B_T * mask_B_T).sum(-1, keepdim=True)).expand_as(log_w_B_T)
    else:
        raw_B_T = torch.exp(log_w_B_T)
    zero = torch.zeros_like(raw_B_T)
    if mode in ("tis", "seq_tis"):
        return raw_B_T.clamp(max=cap), raw_B_T
    if mode in ("mis", "seq_mis"):
        return torch.where((raw_B_T >= 1.0 / cap) & (raw_B_T <= cap), raw_B_T, zero), raw_B_T
    if mode == "decoupled":
        return torch.where(raw_B_T <= cap, raw_B_T, zero), raw_B_T
    if mode == "icepop":
        low, high = ratio_band
        return torch.where((raw_B_T >= low) & (raw_B_T <= high), raw_B_T, zero), raw_B_T
    if mode == "binary_kl":
        inside_B_T = binary_kl(behaviour_logprobs_B_T.detach(), prox_logprobs_B_T.detach()) <= kl_band
        return torch.where(inside_B_T, raw_B_T, zero), raw_B_T
    raise ValueError(f"unknown off-policy correction {mode!r} (expected one of {', '.join(OFF_POLICY)})")


def off_policy_loss(
    base: LossFn,
    mode: str,
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    behaviour_logprobs_B_T: torch.Tensor,
    weights_B_T: torch.Tensor,
    is_cap: float = 2.0,
    ratio_band: tuple[float, float] = (0.5, 5.0),
    kl_band: float = 0.05,
    **kwargs: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A policy loss corrected for samples drawn by an older policy (asynchronous training).

    `old_logprobs_B_T` are the trainer's own logprobs of the tokens before this update (pi_prox), recomputed
    by a no-grad forward; `behaviour_logprobs_B_T` are the sampler's. With the base loss's per-token term
    base_t(r_t), r_t = exp(logp_t - logp_prox_t) (so a PPO clip is taken against pi_prox, not the sampler):

        loss = sum_t weights_t * c_t * base_t(r_t),   c_t = behaviour_weights(...)  (no gradient through c)

    tis:        c_t = min(pi_prox / pi_behaviour, C): truncated importance sampling against the trainer's
                recomputed logprobs (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
                RL Training"; verl's `tis_imp_ratio_cap`).
    mis, seq_tis, seq_mis: masked importance sampling (tokens outside [1/C, C] dropped), and both at the
                sequence level (one ratio per sequence: the product of its tokens'), as in verl's rollout
                importance sampling (`rollout_is_level` token / sequence, `rollout_is_mode` truncate / mask).
    decoupled:  c_t = pi_prox / pi_behaviour, tokens above C dropped: decoupled PPO (Hilton et al. 2022,
                "Batch size-invariance for policy optimization"), as in AReaL (Fu et al. 2025, "AReaL: A
                Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning").
    icepop:     c_t = pi_prox / pi_behaviour, tokens outside [low, high] dropped (IcePop, Ling Team 2025,
                "Every Step Evolves": a band of its own, e.g. [0.5, 5], not tied to the cap; prime-rl's
                token masking by ratio is the same band).
    binary_kl:  c_t = pi_prox / pi_behaviour, tokens whose binary KL (`binary_kl`) exceeds `kl_band` dropped:
                the band is on how far the token's probability moved, not by what factor (DPPO's binary
                divergence trust region; prime-rl masks by its total-variation sibling, |p - q|).
    A KL term of the base loss is weighted by c_t as well (an importance-sampled estimate). Metrics: the base
    loss's (weighted by c_t), plus `is_weight_mean` (raw w_t, or W), `is_capped_fraction` (tokens whose
    weight was capped or dropped) and `is_masked_fraction` (tokens dropped), summed with `weights_B_T`.
    """
    c_B_T, raw_B_T = behaviour_weights(old_logprobs_B_T, behaviour_logprobs_B_T, mode, is_cap, weights_B_T > 0,
                                       ratio_band, kl_band)
    loss, metrics = base(logprobs_B_T, old_logprobs_B_T=old_logprobs_B_T, weights_B_T=weights_B_T * c_B_T,
                         **kwargs)
    metrics["is_weight_mean"] = (raw_B_T * weights_B_T).sum()
    metrics["is_capped_fraction"] = ((c_B_T != raw_B_T).to(weights_B_T.dtype) * weights_B_T).sum()
    metrics["is_masked_fraction"] = (((c_B_T == 0) & (raw_B_T != 0)).to(weights_B_T.dtype) * weights_B_T).sum()
    return loss, metrics
