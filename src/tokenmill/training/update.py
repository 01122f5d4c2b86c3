"""One policy update from a rollout batch: epochs x mini-batches of forward_backward + optim_step.

Algorithm-blind: the loss is looked up by name, aggregation is encoded as per-token weights, and the
reference model (only loaded when kl_coef > 0) is just another forward pass.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from tokenmill.algorithms.aggregation import token_weights
from tokenmill.algorithms.losses import LOSSES
from tokenmill.config.schema import AlgorithmConfig
from tokenmill.training.base import TrainBackend
from tokenmill.training.batch import Batch, collate
from tokenmill.types import Sample

MEAN_METRICS = {"entropy", "clip_fraction", "ratio_mean", "kl"}


def _batch_loss(name: str, algo: AlgorithmConfig):
    fn = LOSSES[name]

    def loss(logprobs_B_T: torch.Tensor, batch: Batch):
        return fn(
            logprobs_B_T,
            old_logprobs_B_T=batch.old_logprobs_B_T,
            advantages=batch.advantages,
            weights_B_T=batch.weights_B_T,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            ref_logprobs_B_T=batch.ref_logprobs_B_T,
            kl_coef=algo.kl_coef,
            kl_estimator=algo.kl_estimator,
        )

    return loss


def _with_reference(batch: Batch, reference) -> Batch:
    return replace(batch, ref_logprobs_B_T=reference.forward(batch)) if reference is not None else batch


def mini_batch_splits(samples: Sequence[Sample], algo: AlgorithmConfig, rng: random.Random) -> Iterator[list[Sample]]:
    """`ppo_epochs` shuffled passes over `samples`, each cut into `mini_batches` interleaved parts."""
    for _ in range(algo.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for mb in range(algo.mini_batches):
            yield [samples[i] for i in order[mb :: algo.mini_batches]]


def _zero_advantage(s: Sample) -> bool:
    return not any(s.token_advantages) if s.token_advantages else s.advantage == 0.0


def policy_update(
    samples: Sequence[Sample],
    backend: TrainBackend,
    algo: AlgorithmConfig,
    *,
    pad_id: int,
    max_tokens: int,
    rng: random.Random,
    reference=None,
) -> dict[str, float]:
    """Train on `samples` (advantages already set); return metrics averaged over optimiser steps."""
    loss_fn = _batch_loss(algo.loss, algo)
    # a zero-advantage sample still carries gradient through the KL term or the entropy bonus
    skip_zero = algo.skip_zero_advantage and reference is None and algo.entropy_coef == 0
    totals: dict[str, float] = {}
    steps = 0
    trained_seqs = 0
    for picked in mini_batch_splits(samples, algo, rng):
        weights = token_weights([sum(s.loss_mask) for s in picked], algo.loss_agg, max_tokens)
        # a zero-advantage sample adds exactly zero gradient (kl off), so it is not run; one is kept
        # when all are zero so that AdamW still takes its (zero-gradient) step as the peers would
        keep = [i for i, s in enumerate(picked) if not (skip_zero and _zero_advantage(s))] or [0]
        batch = collate([picked[i] for i in keep], [weights[i] for i in keep], pad_id)
        metrics = backend.forward_backward(_with_reference(batch, reference), loss_fn, algo.entropy_coef)
        trained_seqs += len(keep)
        # per-token metrics were summed with weights of the whole mini-batch: renormalise to the kept part
        mass = metrics.pop("weight", 0.0)
        for k in MEAN_METRICS & metrics.keys():
            metrics[k] = metrics[k] / mass if mass > 0 else 0.0
        metrics.update(backend.optim_step())
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        steps += 1
    out = {k: v / steps for k, v in totals.items()}
    out["train/optimizer_steps"] = steps
    out["train/sequences_trained"] = trained_seqs
    return out



def value_update(
    samples: Sequence[Sample], critic, algo: AlgorithmConfig, *, pad_id: int, rng: random.Random
) -> dict[str, float]:
    """Train the critic on the GAE returns of `samples`, with the policy's epochs and mini-batches (token-mean
    value loss); return its metrics averaged over optimiser steps, prefixed `critic/`."""
    totals: dict[str, float] = {}
    steps = 0
    for picked in mini_batch_splits(samples, algo, rng):
        weights = token_weights([sum(s.loss_mask) for s in picked], "token_mean")
        metrics = critic.forward_backward(collate(picked, weights, pad_id))
        metrics.update(critic.optim_step())
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        steps += 1
    return {f"critic/{k}": v / steps for k, v in totals.items()}
