"""Trainer ranks as Ray actors (FSDP2, gloo) spread over two nodes; a SIGKILLed rank is detected within
seconds, the group rebuilt from the last sharded checkpoint, and the final weights equal an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training.spec import TrainerSpec
from tokenmill.types import Sample

STEPS = 4
KWARGS = {"learning_rate": 1e-3, "total_steps": 2 * STEPS, "micro_batch_tokens": 40}
ALGO = AlgorithmConfig(mini_batches=2)


def _samples(step: int, vocab: int) -> list[Sample]:
    """Groups of uneven length (a long one of 4, short ones of 2), so the two ranks get uneven shares."""
    return uneven_groups(step, vocab, ((8, 4, 12), (2, 2, 3), (3, 2, 3), (4, 2, 3)))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ranks") / "model", hidden_size=32, num_layers=2, seed=0,
                            tie_word_embeddings=False)


def _uninterrupted(model_path: str, steps: int = STEPS):
    from transformers import AutoModelForCausalLM

    from tokenmill.training import LocalBackend
    from tokenmill.training.update import policy_update

    torch.manual_seed(0)
    local = LocalBackend(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), **KWARGS)
    vocab = local.model.config.vocab_size
    metrics = None
    for step in range(steps):
        metrics = policy_update(_samples(step, vocab), local, ALGO, pad_id=0, max_tokens=12, rng=random.Random(step))
    return {k: v.detach().clone() for k, v in local.model.state_dict().items()}, metrics


def test_a_killed_rank_is_detected_and_the_group_resumes_exactly(ray_cluster, model_path, tmp_path,
                                                                 listening_sockets):
    from tokenmill.config.cluster import ClusterConfig, make_plan
    from tokenmill.controller.ray.workers import (
        BackendSpec,
        RankFailure,
        RayBackend,
        WorkerGroup,
        train_with_restarts,
    )
    from tokenmill.training.update import policy_update

    plan = make_plan(ClusterConfig(backend="ray", nodes=2, cpus_per_node=3, trainer_ranks=2,
                                   strategy="STRICT_SPREAD"))
    assert plan.trainer_nodes() == [0, 1]
    spec = BackendSpec(model_path, str(tmp_path / "shards"), seed=0, trainer=TrainerSpec(**KWARGS), pg_timeout_s=60)
    group = WorkerGroup(ray_cluster, spec, 2, strategy="STRICT_SPREAD", start_timeout_s=180)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    killed: dict[str, float] = {}

    def step_fn(g, step):
        if step == 3 and not killed:  # once: SIGKILL rank 1, then the step's collective
            os.kill(g.ranks[1].pid, signal.SIGKILL)
            killed["at"] = time.monotonic()
            try:
                return g.update(_samples(step, vocab), ALGO, pad_id=0, max_tokens=12, seed=step)
            except RankFailure:
                killed["detected_s"] = time.monotonic() - killed["at"]
                raise
        return g.update(_samples(step, vocab), ALGO, pad_id=0, max_tokens=12, seed=step)

    try:
        first_pids = [r.pid for r in group.ranks]
        assert len({r.node_id for r in group.ranks}) == 2  # one rank per node: placement across nodes
        assert {r.node_id for r in group.ranks} == set(ray_cluster.node_ids)
        report = train_with_restarts(group, STEPS, step_fn, checkpoint_every=2, max_restarts=1)
        assert killed["detected_s"] < 5.0
        assert [(r["failed_at"], r["resumed_from"]) for r in report["restarts"]] == [(3, 2)]
        assert report["restarts"][0]["error"].startswith("trainer update: trainer rank 1 died (ActorDiedError)")
        assert group.generation == 2 and not set(first_pids) & {r.pid for r in group.ranks}
        full = group.call("full_state_dict")[0]
        # one more step with policy_update on the driver, through the TrainBackend verbs
        backend = RayBackend(group)
        driver_metrics = policy_update(_samples(STEPS, vocab), backend, ALGO, pad_id=0, max_tokens=12,
                                       rng=random.Random(STEPS))
        after = dict(backend.weights())
        sockets = listening_sockets()  # the ranks' gloo pairs and store included
        assert {pid for pid, *_ in sockets} >= {r.pid for r in group.ranks}
        assert [s for s in sockets if s[2] != "127.0.0.1"] == []
        print(f"\nrank kill detected in {killed['detected_s']:.2f} s; restart took {report['restarts'][0]['seconds']} s")
    finally:
        group.close()
    want, _ = _uninterrupted(model_path)
    assert sorted(full) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-5, msg=name)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    assert max((want[n] - start[n]).abs().max().item() for n in want) > 1e-3  # 4 steps moved the weights
    want_next, want_metrics = _uninterrupted(model_path, STEPS + 1)
    assert driver_metrics.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert driver_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for name, tensor in want_next.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=1e-5, msg=name)
