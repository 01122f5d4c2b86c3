"""Broadcast weight sync from the trainer ranks to Ray engine replicas (`cluster.weight_sync: broadcast`): after a
push every replica and the driver hold exactly rank 0's weights; a replaced replica catches up and joins the
group; a GRPO run with it ends like one process sampling from a local server."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")

from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training.spec import TrainerSpec

ALGO = AlgorithmConfig(mini_batches=1)


def _served(url: str, name: str, rows: int) -> torch.Tensor:
    answer = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": rows}, timeout=30)
    assert answer.status_code == 200, answer.text
    return torch.tensor(answer.json(), dtype=torch.float32)


def _assert_served(urls: list[str], want: dict[str, torch.Tensor]) -> None:
    for url in urls:
        for name, tensor in want.items():
            assert torch.equal(_served(url, name, tensor.shape[0]), tensor), (url, name)


def test_ranks_broadcast_to_replicas_and_the_driver(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.controller.ray.weights import RankBroadcastSync, RankWeights
    from tokenmill.controller.ray.workers import BackendSpec, RayBackend, WorkerGroup
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.testing import build_tiny_model

    path = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    spec = BackendSpec(path, str(tmp_path / "shards"), trainer=TrainerSpec(learning_rate=1e-2, total_steps=6),
                       pg_timeout_s=60)
    group = WorkerGroup(ray_cluster, spec, 2, start_timeout_s=180)
    fleet = EngineFleet(ray_cluster, path, 2, cpus=1, threads=1, start_timeout_s=120)
    mirror = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    start = {n: p.detach().clone() for n, p in mirror.named_parameters()}
    backend = RayBackend(group, mirror=mirror, broadcast=True)
    sync = RankBroadcastSync(group, fleet.urls, mirror, timeout_s=60)
    engine = RemoteEngine(fleet.urls, pad_id=0, timeout_s=30, cooldown_s=120, retries=1, backoff_s=0.1, sync=sync)
    fleet.attach(engine)
    vocab = mirror.config.vocab_size
    try:
        for step in range(2):
            group.update(uneven_groups(step, vocab, ((8, 4, 12), (2, 2, 3))), ALGO, pad_id=0, max_tokens=12, seed=step)
            weights = backend.weights()
            assert isinstance(weights, RankWeights)  # nothing gathered into the driver
            engine.update_weights(weights, version=step + 1)
            want = dict(RayBackend(group).gathered_weights())
            assert max((want[n] - start[n]).abs().max().item() for n in want) > 1e-3  # the update moved them
            for name, tensor in want.items():  # the driver received the same buckets into its model
                assert torch.equal(dict(mirror.named_parameters())[name].detach(), tensor), name
            _assert_served(fleet.urls, want)
            assert {httpx.get(u + "/health", timeout=10).json()["policy_version"] for u in fleet.urls} == {step + 1}
        assert sync.last_seconds > 0

        # a replica dies: the next push goes to the survivor; the replacement loads the driver's current weights,
        # then joins the next broadcast
        first = list(fleet.urls)
        os.kill(fleet.replicas[0].server_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while fleet._is_alive(fleet.replicas[0]) and time.monotonic() < deadline:
            time.sleep(0.2)  # the SIGKILLed server is reaped
        group.update(uneven_groups(2, vocab, ((8, 4, 12), (2, 2, 3))), ALGO, pad_id=0, max_tokens=12, seed=2)
        engine.update_weights(backend.weights(), version=3)
        assert sync.servers.urls == [first[1]]
        want = dict(RayBackend(group).gathered_weights())
        _assert_served([first[1]], want)
        [new] = fleet.check()
        assert sync.servers.urls == [first[1], new]
        _assert_served([new], want)
        group.update(uneven_groups(3, vocab, ((8, 4, 12), (2, 2, 3))), ALGO, pad_id=0, max_tokens=12, seed=3)
        engine.update_weights(backend.weights(), version=4)
        want = dict(RayBackend(group).gathered_weights())
        _assert_served(fleet.urls, want)
        assert {httpx.get(u + "/health", timeout=10).json()["policy_version"] for u in fleet.urls} == {4}
    finally:
        engine.close()
        fleet.close()
        group.close()


def test_a_colocated_broadcast_run_ends_like_one_process_with_a_local_server(ray_cluster, tmp_path, monkeypatch):
    """GRPO with 2 trainer ranks and 1 replica colocated with rank 0 (`cluster.colocate`), weights broadcast
    (`cluster.weight_sync`): the replica releases its memory once per update and takes it back before the push,
    and the final weights equal (1e-5) a one-process run sampling from a local `tokenmill serve` (the same seeded
    requests): broadcast and colocation change where things run, not what is learnt."""
    from safetensors.torch import load_file

    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.testing import build_tiny_model
    from tokenmill.testing.ray_runs import serve_then_ray, tiny_grpo_tree

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    turns, original = [], EngineFleet.memory_turn

    def recorded(fleet, release):
        turns.append((release, [r.get("success") for r in original(fleet, release)]))

    monkeypatch.setattr(EngineFleet, "memory_turn", recorded)
    want, got = serve_then_ray(ray_cluster, tmp_path, tiny_grpo_tree(model), weight_sync="broadcast", colocate=True)
    assert turns == [(True, [True]), (False, [True])] * 3  # 3 steps: released during each update
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)
    start = load_file(str(next(iter((tmp_path / "m").glob("*.safetensors")))))
    assert max((want[n] - start[n]).abs().max().item() for n in want if n in start) > 1e-4
