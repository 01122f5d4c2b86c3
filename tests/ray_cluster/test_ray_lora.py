"""LoRA on Ray: the adapters on 2 sharded trainer ranks train like one process, and a push carries the adapters
alone, which the engine replica merges: it then serves exactly the weights the driver's peft model makes."""

from __future__ import annotations

import copy
import random

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")

from tokenmill.config import AlgorithmConfig
from tokenmill.testing.samples import uneven_groups
from tokenmill.training.spec import TrainerSpec

KWARGS = {"learning_rate": 1e-2, "total_steps": 4}
ALGO = AlgorithmConfig(mini_batches=1)


def _samples(step: int, vocab: int):
    return uneven_groups(step, vocab, ((8, 4, 12), (2, 2, 3)))


def test_lora_ranks_push_adapters_that_the_replica_merges(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenmill.config.schema import LoRAConfig
    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.controller.ray.weights import RankBroadcastSync, RankWeights, lora_scaling
    from tokenmill.controller.ray.workers import BackendSpec, RayBackend, WorkerGroup
    from tokenmill.sync import merged_lora_weights
    from tokenmill.testing import build_tiny_model
    from tokenmill.training import LocalBackend
    from tokenmill.training.lora import add_lora
    from tokenmill.training.update import policy_update

    path = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    lora = LoRAConfig(rank=4, alpha=8.0)
    torch.manual_seed(5)
    mirror = add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora, task_type="CAUSAL_LM",
                      field="model.lora")
    local = LocalBackend(copy.deepcopy(mirror), **KWARGS)
    spec = BackendSpec(path, str(tmp_path / "shards"), trainer=TrainerSpec(**KWARGS), pg_timeout_s=60, lora=lora)
    group = WorkerGroup(ray_cluster, spec, 2, start_timeout_s=180)
    fleet = EngineFleet(ray_cluster, path, 1, cpus=1, threads=1, start_timeout_s=120)
    sync = RankBroadcastSync(group, fleet.urls, mirror, timeout_s=60, lora_scaling=lora_scaling(lora))
    backend = RayBackend(group, mirror=mirror, broadcast=True)
    vocab = mirror.config.vocab_size
    try:
        group.set_trainable({n: p.detach() for n, p in mirror.named_parameters() if p.requires_grad})
        for step in range(2):
            policy_update(_samples(step, vocab), backend, ALGO, pad_id=0, max_tokens=12, rng=random.Random(step))
            policy_update(_samples(step, vocab), local, ALGO, pad_id=0, max_tokens=12, rng=random.Random(step))
            weights = backend.weights()
            assert isinstance(weights, RankWeights)
            sync.push(weights, version=step + 1)
            # adapter-only: every tensor the ranks pushed is a lora_A or lora_B
            assert sync._layout and all(".lora_A." in n or ".lora_B." in n for n, _, _ in sync._layout)
            ranks = dict(RayBackend(group).gathered_weights())
            trained = dict(local.model.named_parameters())
            for name, tensor in ranks.items():  # 2 sharded ranks train the adapters like one process
                torch.testing.assert_close(tensor, trained[name].detach(), rtol=0, atol=1e-5, msg=name)
                assert torch.equal(dict(mirror.named_parameters())[name].detach(), tensor), name  # the driver's
            merged = dict(merged_lora_weights(mirror))
            assert len(merged) == 14  # 7 linear layers a decoder layer, 2 layers
            for name, tensor in merged.items():  # the replica serves exactly what the peft model computes
                rows = httpx.post(fleet.urls[0] + "/get_weights_by_name", json={"name": name, "truncate_size": 10**6},
                                  timeout=30).json()
                assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor), name
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        assert max((merged[n] - base[n]).abs().max().item() for n in merged) > 1e-4  # the adapters moved them
    finally:
        sync.close()
        fleet.close()
        group.close()


def test_a_lora_run_on_ray_ends_like_one_process_with_a_local_server(ray_cluster, tmp_path):
    """GRPO with LoRA, 2 trainer ranks and 1 replica taking adapter-only broadcasts: the same rewards every step and
    the final adapters within 5e-5 of a one-process LoRA run whose local `tokenmill serve` takes the merged
    weights through files."""
    from tokenmill.testing import build_tiny_model
    from tokenmill.testing.ray_runs import serve_then_ray, tiny_grpo_tree

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    tree = tiny_grpo_tree(model, lora={"rank": 4, "alpha": 8})
    want, got = serve_then_ray(ray_cluster, tmp_path, tree, weight_sync="broadcast")
    assert sorted(got) == sorted(want) and any(".lora_B." in n for n in want)
    # the replica served the weights the local server did: the same samples, so the same rewards every step
    assert _rewards(tmp_path / "ray") == _rewards(tmp_path / "server")
    # two ranks sum each gradient in another order, which AdamW's division by the second moment's root amplifies
    # on near-zero entries (the tolerance of tests/ray_cluster/test_ray_train.py)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=5e-5, msg=name)
    assert max(want[n].abs().max().item() for n in want if ".lora_B." in n) > 1e-3  # the adapters trained


def _rewards(out) -> list[float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]
