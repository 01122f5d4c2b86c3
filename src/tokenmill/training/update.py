"""One policy update from a rollout batch: epochs x mini-batches of forward_backward + optim_step.

Algorithm-blind: the loss is looked up by name, aggregation is encoded as per-token weights, and the
reference model (only loaded when kl_coef > 0) is just another forward pass.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from tokenmill.algorithms.aggregation import token_weights
from tokenmill.algorithms.losses import LOSSES, off_policy_loss
from tokenmill.config.schema import AlgorithmConfig
from tokenmill.training.base import TrainBackend
from tokenmill.training.batch import Batch, collate
from tokenmill.training.router_replay import with_trainer_routes
from tokenmill.types import Sample

MEAN_METRICS = {"entropy", "clip_fraction", "ratio_mean", "kl", "is_weight_mean", "is_capped_fraction",
                "is_masked_fraction", "distill/reverse_kl"}


def _batch_loss(name: str, algo: AlgorithmConfig):
    fn = LOSSES[name]

    def loss(logprobs_B_T: torch.Tensor, batch: Batch):
        kwargs = {
            "old_logprobs_B_T": batch.old_logprobs_B_T,
            "advantages": batch.advantages,
            "weights_B_T": batch.weights_B_T,
            "clip_low": algo.clip_low,
            "clip_high": algo.clip_high,
            "ref_logprobs_B_T": batch.ref_logprobs_B_T,
            "kl_coef": algo.kl_coef,
            "kl_estimator": algo.kl_estimator,
        }
        if batch.behaviour_logprobs_B_T is not None:  # old = the trainer's recomputed logprobs (off_policy)
            return off_policy_loss(fn, algo.off_policy, logprobs_B_T, is_cap=algo.is_cap,
                                   ratio_band=(algo.mask_low, algo.mask_high), kl_band=algo.mask_kl,
                                   behaviour_logprobs_B_T=batch.behaviour_logprobs_B_T, **kwargs)
        return fn(logprobs_B_T, **kwargs)

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


class UpdateWatch(Protocol):
    """A health monitor's view of one policy update (`tokenmill.health.mismatch.MismatchWatch`): called with
    the trainer's logprobs before the update (no extra forward), its `metrics()` join the update's."""

    def __call__(self, batch: Batch, logprobs_B_T: torch.Tensor) -> None: ...

    def metrics(self) -> dict[str, float]: ...


def with_trainer_logprobs(
    samples: Sequence[Sample], backend: TrainBackend, pad_id: int, watch: UpdateWatch | None = None
) -> tuple[list[Sample], dict[int, tuple[float, ...]]]:
    """The samples with their logprobs replaced by the trainer's own before this update (the proximal policy
    of the off-policy correction, one no-grad forward), and the sampler's logprobs keyed by `id(new sample)`.
    A `watch` is shown that forward."""
    batch = collate(samples, [1.0] * len(samples), pad_id)
    logprobs_B_T = backend.forward(batch)
    if watch is not None:
        watch(batch, logprobs_B_T)
    out = list(samples)
    behaviour: dict[int, tuple[float, ...]] = {}
    for row, i in enumerate(batch.sample_index_B.tolist()):
        s = samples[i]
        mine = logprobs_B_T[row, : len(s.tokens)].tolist()
        out[i] = s.with_(logprobs=tuple(lp if m else 0.0 for lp, m in zip(mine, s.loss_mask, strict=True)))
        behaviour[id(out[i])] = s.logprobs
    return out, behaviour


def _watched(loss_fn, watch: UpdateWatch):
    """`loss_fn`, showing `watch` the logprobs of each micro-batch it is called on."""

    def loss(logprobs_B_T: torch.Tensor, batch: Batch):
        watch(batch, logprobs_B_T)
        return loss_fn(logprobs_B_T, batch)

    return loss


def _with_behaviour(batch: Batch, kept: Sequence[Sample], behaviour: dict[int, tuple[float, ...]]) -> Batch:
    width = batch.input_ids_B_T.shape[1]
    rows = [behaviour[id(kept[i])] for i in batch.sample_index_B.tolist()]
    padded = [[*r, *([0.0] * (width - len(r)))] for r in rows]
    return replace(batch, behaviour_logprobs_B_T=torch.tensor(padded, dtype=torch.float32))


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
    watch: UpdateWatch | None = None,
) -> dict[str, float]:
    """Train on `samples` (advantages already set); return metrics averaged over optimiser steps. A `watch`
    is shown the trainer's logprobs before the update, at no extra forward: with an off-policy correction the
    ones it recomputes for all samples, else the first optimiser step's own forward (the samples it trains:
    zero-advantage ones are skipped); its metrics are returned too."""
    loss_fn = _batch_loss(algo.loss, algo)
    # a zero-advantage sample still carries gradient through the KL term, the entropy bonus or distillation's
    # full reverse KL (a backend whose loss carries the teacher: `teacher_in_loss`)
    skip_zero = (algo.skip_zero_advantage and reference is None and algo.entropy_coef == 0
                 and not getattr(backend, "teacher_in_loss", False))
    if getattr(backend, "router_replay", "off") == "r2":  # the experts of the weights before the update
        samples = with_trainer_routes(samples, backend, pad_id)
    behaviour = None
    if algo.off_policy != "none":  # clip against the trainer's own logprobs; weigh by trainer / sampler
        samples, behaviour = with_trainer_logprobs(samples, backend, pad_id, watch)
    totals: dict[str, float] = {}
    steps = 0
    trained_seqs = 0
    for picked in mini_batch_splits(samples, algo, rng):
        weights = token_weights([sum(s.loss_mask) for s in picked], algo.loss_agg, max_tokens)
        # a zero-advantage sample adds exactly zero gradient (kl off), so it is not run; one is kept
        # when all are zero so that AdamW still takes its (zero-gradient) step as the peers would
        keep = [i for i, s in enumerate(picked) if not (skip_zero and _zero_advantage(s))] or [0]
        kept = [picked[i] for i in keep]
        batch = collate(kept, [weights[i] for i in keep], pad_id)
        if behaviour is not None:
            batch = _with_behaviour(batch, kept, behaviour)
        # without that recomputation the first optimiser step's forward is the trainer before the update
        first = watch is not None and behaviour is None and steps == 0
        metrics = backend.forward_backward(_with_reference(batch, reference),
                                           _watched(loss_fn, watch) if first else loss_fn, algo.entropy_coef)
        trained_seqs += len(keep)
        # per-token metrics were summed with weights of the whole mini-batch: renormalise to the kept part
        mass = metrics.pop("weight", 0.0)
        for k in MEAN_METRICS & metrics.keys():
            metrics[k] = metrics[k] / mass if mass > 0 else 0.0
        metrics.update(backend.optim_step())
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        steps += 1
    out = {k: v / steps for k, v in totals.items()} | (watch.metrics() if watch is not None else {})
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
