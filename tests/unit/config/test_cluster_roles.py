"""`cluster.roles`: where the reference, the critic and the reward model run on Ray, in `tokenmill plan`,
`tokenmill validate` and the layout the Composer draws; what cannot be placed is refused before anything starts."""

from __future__ import annotations

import pytest

from tokenmill.cli import main

PPO = """
model: {path: tiny}
data: {task: addition}
algorithm: {advantage: gae, kl_coef: 0.05}
rewards: [{type: model, path: rm}]
cluster:
  backend: ray
  address: auto
  nodes: 2
  cpus_per_node: 4
  gpus_per_node: 4
  trainer_ranks: 4
  engine_replicas: 1
"""

PLACED = PPO + """
  roles:
    reference: {placement: with_trainer}
    critic: {placement: own, ranks: 2, strategy: SPREAD}
    reward_model: {placement: own}
"""


def _run(tmp_path, capsys, command: str, text: str, *overrides: str) -> tuple[int, str, str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    rc = main([command, str(path), *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_old_config_keeps_every_role_in_the_driver_and_the_plan_says_so(tmp_path, capsys):
    rc, out, _ = _run(tmp_path, capsys, "plan", PPO)
    assert rc == 0
    assert out.splitlines()[-6:] == [
        "roles:",
        "  actor         trainer ranks 0-3 (FSDP2 over 4)",
        "  reference     the driver process (unsharded)",
        "  critic        the driver process (unsharded)",
        "  reward model  the driver process",
        "  engines       engine replica 0",
    ]


def test_placed_roles_get_their_own_nodes_and_devices(tmp_path, capsys):
    rc, out, _ = _run(tmp_path, capsys, "plan", PLACED)
    assert rc == 0
    assert out.splitlines()[4:] == [
        "  node 0  trainer rank 0     cuda:0         CPU 1",
        "  node 0  trainer rank 1     cuda:1         CPU 1",
        "  node 0  trainer rank 2     cuda:2         CPU 1",
        "  node 0  trainer rank 3     cuda:3         CPU 1",
        "  node 1  critic rank 0      cuda:0         CPU 1",  # SPREAD, but node 0 is full
        "  node 1  critic rank 1      cuda:1         CPU 1",
        "  node 1  reward model 0     cuda:2         CPU 1",
        "  node 1  engine replica 0   cuda:3         CPU 1",
        "free: node 0: CPU 0, GPU 0; node 1: CPU 0, GPU 0",
        "roles:",
        "  actor         trainer ranks 0-3 (FSDP2 over 4)",
        "  reference     sharded over trainer ranks 0-3 (in their processes)",
        "  critic        a worker group of its own: critic ranks 0-1 (FSDP2 over 2)",
        "  reward model  an actor of its own (reward model 0)",
        "  engines       engine replica 0",
    ]
    # a role the run does not have takes no room: without GAE the critic's devices stay free
    rc, out, _ = _run(tmp_path, capsys, "plan", PLACED, "--algorithm.advantage", "grpo")
    assert rc == 0
    assert "critic rank" not in out and "  critic        none in this run" in out
    assert "free: node 0: CPU 0, GPU 0; node 1: CPU 2, GPU 2" in out


def test_the_layout_lists_each_node_with_its_roles():
    import yaml

    from tokenmill.config.cluster import placement_of_config

    placed = placement_of_config(yaml.safe_load(PLACED) | {"estimate": {"num_devices": 1}})
    node1 = placed["layout"]["nodes"][1]
    assert (node1["gpus"], node1["free_gpus"]) == (4, 0)
    assert [(s["name"], s["device"]) for s in node1["slots"]] == [
        ("critic rank 0", "cuda:0"), ("critic rank 1", "cuda:1"), ("reward model 0", "cuda:2"),
        ("engine replica 0", "cuda:3")]
    assert placed["layout"]["roles"][1] == {"role": "reference",
                                            "where": "sharded over trainer ranks 0-3 (in their processes)"}


@pytest.mark.parametrize(("overrides", "message"), [
    (["--cluster.roles.critic.placement", "nowhere"],
     "cluster.roles.critic.placement: Input should be 'driver', 'with_trainer' or 'own'"),
    (["--cluster.roles.reward_model.placement", "with_trainer"],
     "cluster.roles.reward_model.placement: Input should be 'driver' or 'own'"),
    (["--cluster.roles.critic.gpus_per_rank", "5"],
     "cluster.roles.critic.gpus_per_rank: 5 exceeds cluster.gpus_per_node (4); one rank must fit on one node"),
    (["--cluster.roles.critic.ranks", "5"],
     ("cluster.roles.critic: critic rank 4 does not fit (5 ranks x (CPU 1, GPU 1), strategy SPREAD; no node has "
     "that left; the nodes have CPU 0, GPU 0; CPU 0, GPU 0 left)")),
    (["--cluster.roles.critic.strategy", "STRICT_SPREAD"],
     ("cluster.roles.critic: critic rank 1 does not fit (2 ranks x (CPU 1, GPU 1), strategy STRICT_SPREAD; "
     "STRICT_SPREAD puts each rank on a node of its own")),
    (["--cluster.backend", "local", "--cluster.nodes", "1", "--cluster.trainer_ranks", "1",
      "--cluster.engine_replicas", "0"],
     "cluster.roles.reference.placement: placing a role needs cluster.backend: ray"),
])
def test_what_cannot_be_placed_is_named(tmp_path, capsys, overrides, message):
    for command in ("plan", "validate"):
        rc, out, err = _run(tmp_path, capsys, command, PLACED, *overrides)
        assert rc == 2, command
        assert message in err, command
        assert out == ""


def test_validate_refuses_a_strict_spread_that_cannot_be_placed(tmp_path, capsys):
    """Before, `validate` (and `plan` on a local cluster) said yes, and the run waited for its placement group
    until cluster.start_timeout_s."""
    rc, _, err = _run(tmp_path, capsys, "validate", PPO, "--cluster.strategy", "STRICT_SPREAD",
                      "--cluster.trainer_ranks", "3", "--cluster.engine_replicas", "0")
    assert rc == 2
    assert ("cluster: trainer rank 2 does not fit (3 ranks x (CPU 1, GPU 1) on 2 node(s) x (CPU 4, GPU 4), "
            "strategy STRICT_SPREAD)") in err
    no_reward_model = PPO.replace("rewards: [{type: model, path: rm}]\n", "")  # validate checks its folder
    rc, out, _ = _run(tmp_path, capsys, "validate", no_reward_model, "--cluster.strategy", "STRICT_SPREAD",
                      "--cluster.trainer_ranks", "2")
    assert rc == 0 and "valid." in out
