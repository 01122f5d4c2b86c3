"""`tokenmill plan`: the placement of trainer ranks and engine replicas from `cluster:`, with nothing started."""

from __future__ import annotations

import pytest

from tokenmill.cli import main

TWO_NODES = """
model: {path: tiny}
data: {task: addition}
cluster:
  backend: ray
  nodes: 2
  cpus_per_node: 4
  gpus_per_node: 2
  trainer_ranks: 3
  engine_replicas: 1
"""


def _plan(tmp_path, capsys, text: str, *overrides: str) -> tuple[int, str, str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    rc = main(["plan", str(path), *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_two_node_plan_packs_ranks_then_engines(tmp_path, capsys):
    rc, out, _ = _plan(tmp_path, capsys, TWO_NODES)
    assert rc == 0
    assert out.splitlines() == [
        "cluster: ray, start a local cluster of 2 nodes on 127.0.0.1 (no dashboard)",
        "nodes: 2 x (CPU 4, GPU 2)",
        "trainer: 3 rank(s) x (CPU 1, GPU 1), strategy PACK, max_restarts 2",
        "engines: 1 x (CPU 1, GPU 1), on devices of their own",
        "  node 0  trainer rank 0     cuda:0         CPU 1",
        "  node 0  trainer rank 1     cuda:1         CPU 1",
        "  node 1  trainer rank 2     cuda:0         CPU 1",
        "  node 1  engine replica 0   cuda:1         CPU 1",
        "free: node 0: CPU 2, GPU 0; node 1: CPU 2, GPU 0",
        # an old config: every other model where it always ran, and the plan says so
        "roles:",
        "  actor         trainer ranks 0-2 (FSDP2 over 3)",
        "  reference     none in this run",
        "  critic        none in this run",
        "  reward model  none in this run",
        "  engines       engine replica 0",
        # two local nodes would both hand out this machine's GPU 0 and 1: said here, refused by `tokenmill train`
        ("note: cluster.address: null starts every node on this machine, where they would share its GPUs; "
         "`tokenmill train` refuses it: start one node per machine (`ray start`) and set cluster.address"),
    ]
    rc, _, err = _plan(tmp_path, capsys, TWO_NODES, "--cluster.engine_replicas", "2")
    assert rc == 2
    assert ("cluster: engine replica 1 does not fit: after the trainer ranks, the nodes have CPU 2, GPU 0; "
            "CPU 2, GPU 0 left, a replica needs CPU 1, GPU 1") in err


def test_spread_and_colocated_on_cpu_nodes(tmp_path, capsys):
    rc, out, _ = _plan(tmp_path, capsys, TWO_NODES, "--cluster.gpus_per_node", "0", "--cluster.strategy", "SPREAD",
                       "--cluster.colocate", "true", "--cluster.address", "auto", "--cluster.engine_replicas", "2")
    assert rc == 0
    assert out.splitlines() == [
        "cluster: ray, join the cluster on this machine (address: auto)",
        "nodes: 2 x (CPU 4, GPU 0)",
        "trainer: 3 rank(s) x (CPU 1, GPU 0), strategy SPREAD, max_restarts 2",
        "engines: 2 x (CPU 1, GPU 0), colocated with the trainer ranks",
        "  node 0  trainer rank 0     cpu            CPU 1",
        "  node 0  trainer rank 2     cpu            CPU 1",
        "  node 0  engine replica 0   cpu            CPU 1",
        "  node 1  trainer rank 1     cpu            CPU 1",
        "  node 1  engine replica 1   cpu            CPU 1",
        "free: node 0: CPU 1, GPU 0; node 1: CPU 2, GPU 0",
        "roles:",
        "  actor         trainer ranks 0-2 (FSDP2 over 3)",
        "  reference     none in this run",
        "  critic        none in this run",
        "  reward model  none in this run",
        "  engines       engine replicas 0-1 (colocated with the trainer ranks)",
    ]


@pytest.mark.parametrize(("overrides", "message"), [
    (["--cluster.trainer_ranks", "5"],
     "cluster: trainer rank 4 does not fit (5 ranks x (CPU 1, GPU 1) on 2 node(s) x (CPU 4, GPU 2), strategy PACK)"),
    (["--cluster.gpus_per_rank", "3"],
     "cluster.gpus_per_rank: 3 exceeds cluster.gpus_per_node (2); one rank must fit on one node"),
    (["--cluster.colocate", "true", "--cluster.engine_replicas", "4"],
     ("cluster.engine_replicas: colocated engines share a trainer rank's devices, so at most "
     "cluster.trainer_ranks (3), got 4")),
    (["--cluster.address", "headnode"], "cluster.address: 'auto', 'host:port' or null, got 'headnode'"),
    (["--cluster.backend", "local"], "cluster.backend: trainer_ranks, engine_replicas and nodes are laid out by Ray"),
])
def test_what_does_not_fit_is_named(tmp_path, capsys, overrides, message):
    rc, out, err = _plan(tmp_path, capsys, TWO_NODES, *overrides)
    assert rc == 2
    assert message in err
    assert out == ""


def test_the_memory_estimate_shows_the_placement_and_shards_over_the_ranks():
    from tokenmill.estimate import estimate_for_config

    cluster = {"backend": "ray", "nodes": 2, "cpus_per_node": 4, "gpus_per_node": 2, "trainer_ranks": 2,
               "engine_replicas": 2}
    base = {"model": {"path": "Qwen/Qwen2.5-0.5B"}, "data": {"task": "addition"}}
    placed = estimate_for_config({**base, "cluster": cluster})
    alone = estimate_for_config(base)
    assert "placement" not in alone
    assert (placed["settings"]["num_devices"], placed["settings"]["sharding"]) == (2, "fsdp")
    assert placed["placement"] == {
        "nodes": 2, "trainer_ranks": 2, "engine_replicas": 2, "colocate": False,
        "trainer_devices": ["node 0 cuda:0", "node 0 cuda:1"], "engine_devices": ["node 1 cuda:0", "node 1 cuda:1"],
        "lines": placed["placement"]["lines"], "layout": placed["placement"]["layout"],
    }
    assert placed["placement"]["lines"][4] == "  node 0  trainer rank 0     cuda:0         CPU 1"
    # the trainer's weights, gradients and optimiser state are split over the 2 ranks (not what stays whole)
    ratio = placed["devices"][0]["persistent_bytes"] / alone["devices"][0]["persistent_bytes"]
    assert 0.5 < ratio < 0.7


@pytest.mark.parametrize(("override", "match"), [
    ({"critic": {"lora": {"rank": 4}}}, r"critic.lora: cluster.backend ray trains a full critic"),
    ({"model": {"lora": {"rank": 4}}, "cluster": {"engine_replicas": 1}},
     r"model.lora: LoRA on Ray's engine replicas pushes the adapters alone"),
    ({"engine": {"placement": "thread"}}, r"engine.placement: 'thread' on Ray needs cluster.engine_replicas > 0"),
    ({"engine": {"placement": "process"}}, r"engine.placement: 'process' on Ray needs cluster.engine_replicas"),
    ({"engine": {"placement": "thread"}, "cluster": {"engine_replicas": 1}},
     r"engine.placement: cluster.engine_replicas starts `tokenmill serve` replicas on Ray; leave"),
    ({"engine": {"placement": "process", "sync": "broadcast"}, "cluster": {"engine_replicas": 1}},
     r"engine.sync: the Ray engine replicas take weights as cluster.weight_sync says"),
    ({"cluster": {"nodes": 2, "gpus_per_node": 1}}, r"cluster.address: null starts every node on this machine"),
])
def test_training_on_ray_refuses_what_it_does_not_run_yet(override, match):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller.ray.run import train_on_ray
    from tokenmill.types import ConfigError

    tree = {"model": {"path": "tiny"}, "data": {"task": "addition"}, "cluster": {"backend": "ray"}}
    for section, values in override.items():
        tree[section] = {**tree.get(section, {}), **values}
    with pytest.raises(ConfigError, match=match):
        train_on_ray(load_config(RLConfig, tree))  # refused before any cluster is started
