"""`policy_update`'s watch: a monitor is shown the trainer's logprobs before the update, from the off-policy
recomputation of every sample or else from the first optimiser step's forward, and its metrics are returned."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenmill.config import AlgorithmConfig
from tokenmill.health.mismatch import MismatchWatch
from tokenmill.training import LocalBackend
from tokenmill.training.update import policy_update, with_trainer_logprobs
from tokenmill.types import Sample, StopReason


def _samples(n=6, seed=0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(tokens=tuple(rng.randint(3, 60) for _ in range(7)), loss_mask=(0,) * 3 + (1,) * 4,
                   logprobs=(0.0,) * 7, prompt_len=3, prompt="p", completion="c", stop_reason=StopReason.STOP,
                   advantage=1.0 if i % 2 else -1.0) for i in range(n)]


def _halved(model_path) -> list[Sample]:
    """Samples whose sampler gave every trained token half the trainer's probability: a gap of log 2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    exact, _ = with_trainer_logprobs(_samples(), LocalBackend(model, learning_rate=1e-3, total_steps=1), pad_id=0)
    return [s.with_(logprobs=tuple(lp - math.log(2) if m else 0.0 for lp, m in zip(s.logprobs, s.loss_mask,
                                                                                   strict=True))) for s in exact]


def _update(model_path, samples, watch_it: bool, **algo):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    backend = LocalBackend(model, learning_rate=1e-1, total_steps=1, temperature=1.0)
    watch = MismatchWatch(backend) if watch_it else None
    return policy_update(samples, backend, AlgorithmConfig(mini_batches=2, **algo), pad_id=0, max_tokens=4,
                         rng=random.Random(0), watch=watch)


@pytest.mark.parametrize("off_policy, tokens", [("none", 12), ("tis", 24)])
def test_the_watch_sees_the_trainer_before_the_update(tiny_model_path, off_policy, tokens):
    samples = _halved(tiny_model_path)
    got = _update(tiny_model_path, samples, True, off_policy=off_policy)
    # the first mini-batch's 3 samples x 4 trained tokens, or every sample's (the recomputation); each token's gap
    # is log 2 against the trainer before its step (a learning rate of 0.1 moves the second mini-batch's far)
    assert got["mismatch/tokens"] == tokens and got["mismatch/temperature"] == 1.0
    assert got["mismatch/mean_abs"] == pytest.approx(math.log(2), abs=1e-5)
    assert got["mismatch/max_abs"] == pytest.approx(math.log(2), abs=1e-5)
    assert got["mismatch/kl"] == pytest.approx(1 - math.log(2), abs=1e-5)  # r - 1 - log r at r = 2
    assert got["train/optimizer_steps"] == 2
    # the watch changes nothing of the update
    plain = _update(tiny_model_path, samples, False, off_policy=off_policy)
    assert not any(k.startswith("mismatch/") for k in plain)
    assert {k: v for k, v in got.items() if not k.startswith("mismatch/")} == plain
