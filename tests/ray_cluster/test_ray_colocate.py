"""`cluster.colocate: true` with engine replicas: replica i runs in trainer rank i's placement-group bundle (its
node, its devices, no resources of its own), lets go of its memory while the ranks update and takes it back
before the new weights arrive; a colocated GRPO run trains like the disaggregated one."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")

from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training.spec import TrainerSpec


def _memory_answer(url: str, release: bool) -> dict:
    route = "/release_memory_occupation" if release else "/resume_memory_occupation"
    return httpx.post(url + route, timeout=30).json()


def test_colocated_replicas_share_their_ranks_bundles_and_take_turns(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.controller.ray.weights import RankBroadcastSync
    from tokenmill.controller.ray.workers import BackendSpec, RayBackend, WorkerGroup
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.testing import build_tiny_model
    from tokenmill.training.update import policy_update

    path = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=1, seed=0, tie_word_embeddings=False)
    spec = BackendSpec(path, str(tmp_path / "shards"), trainer=TrainerSpec(learning_rate=1e-2, total_steps=4),
                       pg_timeout_s=60)
    group = WorkerGroup(ray_cluster, spec, 2, strategy="STRICT_SPREAD", start_timeout_s=180)
    free_before = ray.available_resources().get("CPU", 0)
    fleet = EngineFleet(ray_cluster, path, 2, cpus=1, threads=1, start_timeout_s=120, colocate_with=group)
    mirror = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    backend = RayBackend(group, mirror=mirror, broadcast=True)
    backend.sharing = fleet
    engine = RemoteEngine(fleet.urls, pad_id=0, timeout_s=30, sync=RankBroadcastSync(group, fleet.urls, mirror,
                                                                                      timeout_s=60))
    try:
        # replica i on rank i's node, inside its bundle: the fleet took no CPU of its own
        assert [r.node_id for r in fleet.replicas] == [r.node_id for r in group.ranks]
        assert len({r.node_id for r in fleet.replicas}) == 2
        assert ray.available_resources().get("CPU", 0) == free_before
        vocab = mirror.config.vocab_size
        turns = []
        original = fleet.memory_turn

        def recorded(release):
            turns.append((release, [r["success"] for r in original(release)]))

        fleet.memory_turn = recorded
        for step in range(2):
            policy_update(uneven_groups(step, vocab, ((8, 4, 12), (2, 2, 3))), backend, AlgorithmConfig(mini_batches=2),
                          pad_id=0, max_tokens=12, rng=random.Random(step))
            assert turns[-1] == (True, [True, True])  # released once for the whole update (2 mini-batches)
            engine.update_weights(backend.weights(), version=step + 1)
            assert turns[-1] == (False, [True, True])  # restored before the weights came
        assert [t[0] for t in turns] == [True, False, True, False] and fleet.memory_turns == 2
        want = dict(RayBackend(group).gathered_weights())
        for url in fleet.urls:
            for name, tensor in want.items():
                rows = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10**6},
                                  timeout=30).json()
                assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor), (url, name)
        # an engine with release_memory (the local engines') counts the releases; the answer says either way
        answer = _memory_answer(fleet.urls[0], release=True)
        assert answer["success"] is True
        if answer["supported"]:
            assert answer["releases"] == 3
        _memory_answer(fleet.urls[0], release=False)
    finally:
        engine.close()
        fleet.close()
        group.close()
