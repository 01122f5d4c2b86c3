"""`cluster.roles` on a real (two-node, loopback) Ray cluster: the session's cluster is what `address: null,
nodes: 2` starts; a PPO run with its KL reference sharded over the trainer ranks, its critic in a worker group
of its own and its reward model in an actor of its own trains like one process; a layout the cluster cannot
hold is refused before anything starts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from tokenmill.testing.ray_runs import digit_share


def _reward_model(folder: Path) -> str:
    """A tiny scalar-head reward model with clearly distinct scores."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tokenmill.testing import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(5)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, num_labels=1, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _config(model: str, rm: str, out: str, **cluster) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "algorithm": {"mini_batches": 2, "advantage": "gae", "kl_coef": 0.05},
        "rewards": [{"type": "model", "path": rm, "name": "rm", "weight": 0.1}],
        "training": {"learning_rate": 1e-3, "seed": 3, "micro_batch_tokens": 64},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": out, "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
        **({"cluster": cluster} if cluster else {}),
    }


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_session_cluster_is_two_local_nodes(ray_cluster):
    """`connect(None, nodes=2)` (a run's `address: null, nodes: 2`) starts two raylets, not one big node."""
    nodes = ray_cluster.nodes()
    assert ray_cluster.started and ray_cluster.local_nodes is not None
    assert len(nodes) == 2 and len({n["node_id"] for n in nodes}) == 2
    assert [n["resources"]["CPU"] for n in nodes] == [3.0, 3.0]
    assert {n["address"] for n in nodes} == {"127.0.0.1"}


def test_a_layout_the_cluster_cannot_hold_is_refused_at_once(ray_cluster, tmp_path):
    """Three STRICT_SPREAD ranks on a joined two-node cluster: refused before any actor or placement group, not
    after cluster.start_timeout_s."""
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray.cluster import ClusterError
    from tokenmill.controller.ray.run import train_on_ray

    cfg = load_config(RLConfig, {
        "model": {"path": "unused"}, "data": {"task": "addition"}, "tracking": {"output_dir": str(tmp_path)},
        "cluster": {"backend": "ray", "nodes": 3, "cpus_per_node": 3, "trainer_ranks": 3,
                    "strategy": "STRICT_SPREAD", "start_timeout_s": 300}})
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"cluster.nodes: the plan lays out 3 node\(s\) x \(CPU 3, GPU 0\); the "
                       r"cluster at .* has 2 such node\(s\) \(2 live: CPU 3, GPU 0; CPU 3, GPU 0\)"):
        train_on_ray(cfg, cluster=ray_cluster)
    assert time.monotonic() - t0 < 10
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_reference_critic_and_reward_model_placed_off_the_driver_train_like_one_process(
        ray_cluster, tmp_path, monkeypatch):
    import tokenmill
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray import roles
    from tokenmill.controller.ray.run import train_on_ray
    from tokenmill.testing import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    rm = _reward_model(tmp_path / "rm")
    tokenmill.train(_config(model, rm, str(tmp_path / "alone")), rewards=[digit_share])

    started, calls = [], {"reference": 0, "critic": 0}
    original_start, original_forward, original_call = roles.start_roles, roles.RayReference.forward, roles.RayCritic._call

    def start(*args, **kwargs):
        started.append(original_start(*args, **kwargs))
        return started[-1]

    def forward(self, batch):
        calls["reference"] += 1
        return original_forward(self, batch)

    def call(self, method, *args):
        calls["critic"] += 1
        return original_call(self, method, *args)

    monkeypatch.setattr(roles, "start_roles", start)
    monkeypatch.setattr(roles.RayReference, "forward", forward)
    monkeypatch.setattr(roles.RayCritic, "_call", call)
    cfg = load_config(RLConfig, _config(
        model, rm, str(tmp_path / "ray"), backend="ray", nodes=2, cpus_per_node=3, trainer_ranks=2,
        max_restarts=0, call_timeout_s=120,
        roles={"reference": {"placement": "with_trainer"}, "critic": {"placement": "own", "ranks": 2},
               "reward_model": {"placement": "own"}}))
    train_on_ray(cfg, rewards=[digit_share], cluster=ray_cluster)

    [placed] = started
    trainer_pids = {r.pid for r in placed.trainer.ranks}
    critic_pids = {r.pid for r in placed.own["critic"].ranks}
    assert len(trainer_pids) == 2 and len(critic_pids) == 2 and not trainer_pids & critic_pids
    assert os.getpid() not in trainer_pids | critic_pids
    assert placed.trainer.spec.roles == ("policy", "reference") and placed.own["critic"].spec.roles == ("critic",)
    assert calls["reference"] >= 3 and calls["critic"] >= 3 * 3  # each step: values, then a step per mini-batch
    # the reward model actor scored every step: its reward is logged, as the driver's would be
    want, got = _metrics(tmp_path / "alone"), _metrics(tmp_path / "ray")
    assert len(got) == len(want) == 3
    for w, g in zip(want, got, strict=True):
        for key in ("reward/rm/mean", "kl", "critic/value_mean", "critic/value_loss", "critic/return_mean"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    assert max(abs(r["kl"]) for r in got) > 0 and max(abs(r["critic/value_mean"]) for r in got) > 0
    final = max((tmp_path / "ray" / "checkpoints").glob("step_*")) / "model.safetensors"
    want_w = load_file(str(max((tmp_path / "alone" / "checkpoints").glob("step_*")) / "model.safetensors"))
    got_w = load_file(str(final))
    for name, tensor in want_w.items():  # two ranks against one process: see test_ray_train.py
        torch.testing.assert_close(got_w[name], tensor, rtol=0, atol=5e-5, msg=name)


@pytest.mark.slow  # two minutes of actor start-ups on 2 cores: `pytest -m slow tests/ray_cluster`
def test_a_killed_critic_rank_rebuilds_every_group_and_the_run_resumes_exactly(ray_cluster, tmp_path, monkeypatch):
    """The critic in a group of its own; its rank SIGKILLed before step 2's values: the run rebuilds the trainer's
    and the critic's groups, resumes from the step-1 checkpoint (the critic's shards among it) and ends with
    the weights of an uninterrupted one-process run."""
    import signal

    import tokenmill
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray import roles
    from tokenmill.controller.ray.run import train_on_ray
    from tokenmill.testing import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    tree = _config(model, "", str(tmp_path / "alone")) | {"checkpoint": {"every": 1, "save_final": True}}
    tree.pop("rewards")
    tree["algorithm"]["kl_coef"] = 0.0
    tokenmill.train(tree, rewards=[digit_share])

    original, killed = roles.RayCritic.values, []

    def values(self, batch):
        if self.group.generation == 1 and not killed and values.calls == 1:  # step 2, first group only
            killed.append(self.group.ranks[0].pid)
            os.kill(killed[0], signal.SIGKILL)
        values.calls += 1
        return original(self, batch)

    values.calls = 0
    monkeypatch.setattr(roles.RayCritic, "values", values)
    tree["tracking"]["output_dir"] = str(tmp_path / "ray")
    tree["cluster"] = {"backend": "ray", "nodes": 2, "cpus_per_node": 3, "trainer_ranks": 2, "max_restarts": 1,
                       "call_timeout_s": 120, "roles": {"critic": {"placement": "own"}}}
    result = train_on_ray(load_config(RLConfig, tree), rewards=[digit_share], cluster=ray_cluster)
    assert killed and result["restarts"] == 1 and result["resumed_from"] == 1
    assert sorted(p.name for p in (tmp_path / "ray" / "checkpoints" / "shards").glob("critic-step-*"))
    want = load_file(str(max((tmp_path / "alone" / "checkpoints").glob("step_*")) / "model.safetensors"))
    got = load_file(str(max((tmp_path / "ray" / "checkpoints").glob("step_*")) / "model.safetensors"))
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=5e-5, msg=name)
