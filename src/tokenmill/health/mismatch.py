"""The gap between the engine's logprobs and the trainer's, per token.

The engine samples token t and reports logp_engine_t; the trainer, before its update, recomputes logp_trainer_t
for the same token (the same temperature). With d_t = logp_trainer_t - logp_engine_t and r_t = exp(d_t):

    mismatch/mean_abs           mean_t |d_t|
    mismatch/max_abs            max_t |d_t|
    mismatch/kl                 mean_t (r_t - 1 - d_t): Schulman's k3 estimate of KL(engine || trainer) per
                                token. The tokens are drawn from the engine, so E_engine[r - 1 - log r] is that KL
                                exactly, and every term is >= 0 (k1, -d_t, has the same mean but is noisy and
                                can be negative).
    mismatch/out_of_range_frac  share of tokens with r_t outside [0.5, 2]: the tokens an importance-sampling
                                correction with cap 2 would truncate or mask

All means are over the trained tokens (mask 1); 0 when there are none. `MismatchMonitor` measures them every
`health.mismatch_every` steps through a `MismatchWatch` on the policy update, at no extra forward.
"""

from __future__ import annotations

import torch

RATIO_RANGE = (0.5, 2.0)


def mismatch_stats(engine_logprobs_B_T: torch.Tensor, trainer_logprobs_B_T: torch.Tensor,
                   mask_B_T: torch.Tensor) -> dict[str, float]:
    """The four `mismatch/*` metrics (module docstring) of B sequences of T positions; `mask_B_T` is 1 on
    the tokens the engine sampled and the loss trains, 0 elsewhere (prompt, environment, padding)."""
    sums = mismatch_sums(engine_logprobs_B_T, trainer_logprobs_B_T, mask_B_T)
    return finish(sums)


def mismatch_sums(engine_logprobs_B_T: torch.Tensor, trainer_logprobs_B_T: torch.Tensor,
                  mask_B_T: torch.Tensor) -> dict[str, float]:
    """The sums the metrics are made of (`tokens`, `abs`, `max_abs`, `kl`, `out`), so that batches can be
    added up before `finish` (a mean of means would weigh a short batch like a long one)."""
    keep = mask_B_T.bool()
    d = (trainer_logprobs_B_T.double() - engine_logprobs_B_T.double())[keep]
    if d.numel() == 0:
        return {"tokens": 0.0, "abs": 0.0, "max_abs": 0.0, "kl": 0.0, "out": 0.0}
    r = torch.exp(d)
    low, high = RATIO_RANGE
    return {"tokens": float(d.numel()), "abs": d.abs().sum().item(), "max_abs": d.abs().max().item(),
            "kl": (r - 1 - d).sum().item(), "out": ((r < low) | (r > high)).sum().item()}


def add_sums(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: max(a[k], b[k]) if k == "max_abs" else a[k] + b[k] for k in a}


def finish(sums: dict[str, float]) -> dict[str, float]:
    """`mismatch/*` from summed parts."""
    n = sums["tokens"]
    if not n:
        return {"mismatch/mean_abs": 0.0, "mismatch/max_abs": 0.0, "mismatch/kl": 0.0,
                "mismatch/out_of_range_frac": 0.0, "mismatch/tokens": 0.0}
    return {"mismatch/mean_abs": sums["abs"] / n, "mismatch/max_abs": sums["max_abs"], "mismatch/kl": sums["kl"] / n,
            "mismatch/out_of_range_frac": sums["out"] / n, "mismatch/tokens": n}


class MismatchWatch:
    """The `mismatch/*` of one policy update: `policy_update(..., watch=)` (`training.update.UpdateWatch`) shows it
    the trainer's logprobs before the update (the off-policy recomputation of every sample, else each
    micro-batch of the first optimiser step, whose forward is the trainer before it steps: no extra forward),
    and it adds up their gap to the sampler's (`batch.old_logprobs_B_T`) on the trained tokens.
    `mismatch/temperature` is the temperature the trainer divided its logits by (the engine's logprobs are of
    softmax(logits / its temperature): a different one shows up as a gap)."""

    def __init__(self, backend) -> None:
        self.backend, self.sums = backend, []

    def __call__(self, batch, logprobs_B_T: torch.Tensor) -> None:
        self.sums.append(mismatch_sums(batch.old_logprobs_B_T, logprobs_B_T.detach(), batch.weights_B_T > 0))

    def metrics(self) -> dict[str, float]:
        """`mismatch/*` of what it was shown ({} when nothing was)."""
        if not self.sums:
            return {}
        total = self.sums[0]
        for part in self.sums[1:]:
            total = add_sums(total, part)
        temperature = getattr(self.backend, "temperature", None)
        at = {"mismatch/temperature": float(temperature)} if isinstance(temperature, (int, float)) else {}
        return finish(total) | at


class MismatchMonitor:
    """`health.mismatch_every`: a `MismatchWatch` on every `every`-th step's policy update (0: never)."""

    def __init__(self, every: int, backend) -> None:
        self.every, self.backend = every, backend

    def watch_update(self, step: int) -> MismatchWatch | None:
        return MismatchWatch(self.backend) if self.every and step % self.every == 0 else None
