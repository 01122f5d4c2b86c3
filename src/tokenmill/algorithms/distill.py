"""On-policy distillation: per-token advantages from a teacher's logprobs of the student's own tokens.

The student samples a completion; a teacher scores every sampled token (teacher forcing). The per-token
reverse KL estimate is the log ratio `logp_student(x_t) - logp_teacher(x_t)` at the sampled token `x_t`; its
expectation under the student is KL(student || teacher) at that position. Its negative is the token's
advantage, so the policy-gradient loss lowers exactly the reverse KL (Agarwal et al. 2024, GKD; Thinking
Machines' on-policy distillation, 2025), optionally mixed with a task reward's group advantage:

    A_t = -kl_coef * (logp_student_t - logp_teacher_t) + task_weight * A_task        (0 where mask_t = 0)

Top-k teachers (a server that returns only the k most likely tokens per position) are handled by
*bucketing*: each position's distribution is coarsened to k + 1 outcomes, the teacher's top-k tokens and one
"other" outcome holding the remaining mass of both distributions. A sampled token inside the top-k keeps its
own logprobs; a sampled token outside it is the outcome "other", with `log(1 - sum of the top-k
probabilities)` on each side. The estimate is then an unbiased one-sample estimate of the reverse KL between
the coarsened distributions, which never exceeds the full reverse KL (data processing inequality).
`bucketed_reverse_kl` is that coarsened KL computed exactly, for the trainer's full-KL loss term.
"""

from __future__ import annotations

import torch

OTHER_FLOOR = 1e-12  # least probability of the "other" bucket (a top-k list that holds all the mass)


def distill_advantages(
    student_logprobs_B_T: torch.Tensor,
    teacher_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    kl_coef: float = 1.0,
    task_advantages_B: torch.Tensor | None = None,
    task_weight: float = 0.0,
) -> torch.Tensor:
    """Per-token advantages `A_B_T` (see the module docstring).

    student_logprobs_B_T: the sampler's logprob of each sampled token
    teacher_logprobs_B_T: the teacher's logprob of the same token (any value where mask is 0)
    mask_B_T:             1 on the student's completion tokens, 0 on prompt, environment and pad tokens
    task_advantages_B:    one advantage per sequence from the task reward (GRPO's group advantage), mixed in
                          with weight `task_weight` on every completion token
    """
    mask = mask_B_T.to(student_logprobs_B_T.dtype)
    log_ratio_B_T = (student_logprobs_B_T - teacher_logprobs_B_T) * mask
    adv_B_T = -kl_coef * log_ratio_B_T
    if task_weight and task_advantages_B is not None:
        adv_B_T = adv_B_T + task_weight * task_advantages_B.to(adv_B_T.dtype)[:, None] * mask
    return adv_B_T


def _other(logprobs_B_T_K: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k): the log mass outside the listed tokens, floored at OTHER_FLOOR."""
    listed = logprobs_B_T_K.exp().sum(-1)
    return torch.log((1.0 - listed).clamp(min=OTHER_FLOOR))


def bucketed_logprobs(
    sampled_B_T: torch.Tensor,
    top_ids_B_T_K: torch.Tensor,
    teacher_top_B_T_K: torch.Tensor,
    student_top_B_T_K: torch.Tensor,
    student_logprobs_B_T: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(student, teacher) logprobs of the sampled outcome once each position is coarsened to the teacher's
    top-k tokens plus "other" (see the module docstring).

    sampled_B_T:       the sampled token ids
    top_ids_B_T_K:     the teacher's top-k token ids at each position (pad with -1 where fewer than K)
    teacher_top_B_T_K: the teacher's logprobs of those ids (-inf at pads)
    student_top_B_T_K: the student's logprobs of the same ids (-inf at pads)
    student_logprobs_B_T: the student's logprob of the sampled token

    A sampled token in the top-k: (student logprob, teacher's listed logprob). Outside it:
    (log(1 - sum student_top.exp()), log(1 - sum teacher_top.exp())).
    """
    hit_B_T_K = top_ids_B_T_K == sampled_B_T.unsqueeze(-1)
    inside_B_T = hit_B_T_K.any(-1)
    teacher_hit_B_T = torch.where(hit_B_T_K, teacher_top_B_T_K, torch.zeros_like(teacher_top_B_T_K)).sum(-1)
    student = torch.where(inside_B_T, student_logprobs_B_T, _other(student_top_B_T_K))
    teacher = torch.where(inside_B_T, teacher_hit_B_T, _other(teacher_top_B_T_K))
    return student, teacher


def bucketed_reverse_kl(student_top_N_K: torch.Tensor, teacher_top_N_K: torch.Tensor) -> torch.Tensor:
    """The exact reverse KL between the two distributions coarsened to the teacher's top-k plus "other" (see
    the module docstring), at each of N positions: `sum_k p_s(k) (log p_s(k) - log p_t(k)) + p_s(other)
    (log p_s(other) - log p_t(other))`, differentiable through the student's logprobs of the listed tokens.

    student_top_N_K: the student's logprobs of the teacher's listed tokens (any value at pads)
    teacher_top_N_K: the teacher's logprobs of them (-inf at pads: fewer than K listed)
    """
    listed = torch.isfinite(teacher_top_N_K)
    s = torch.where(listed, student_top_N_K, torch.zeros_like(student_top_N_K))  # no -inf: finite gradients
    t = torch.where(listed, teacher_top_N_K, torch.zeros_like(teacher_top_N_K)).to(s.dtype)
    inside = torch.where(listed, s.exp() * (s - t), torch.zeros_like(s)).sum(-1)
    s_other = torch.log((1.0 - (s.exp() * listed).sum(-1)).clamp(min=OTHER_FLOOR))
    t_other = torch.log((1.0 - (t.exp() * listed).sum(-1)).clamp(min=OTHER_FLOOR))
    return inside + s_other.exp() * (s_other - t_other)


def mixture_logprobs(logprobs_N_B_T: torch.Tensor) -> torch.Tensor:
    """The logprob under the mixture (the mean in probability) of N teachers: logsumexp over N minus log N."""
    n = logprobs_N_B_T.shape[0]
    return torch.logsumexp(logprobs_N_B_T, dim=0) - torch.log(torch.tensor(float(n), dtype=logprobs_N_B_T.dtype))
