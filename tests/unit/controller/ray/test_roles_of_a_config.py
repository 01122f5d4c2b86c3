"""What each Ray worker group builds for a config's `cluster.roles` (no Ray needed): an old config's trainer ranks
build the policy alone; a role with the trainer rides in the trainer ranks' spec; a role of its own gets a group
spec of its own; the driver's run is handed the group that computes each placed role."""

from __future__ import annotations

from tokenmill.config import RLConfig, load_config
from tokenmill.controller.ray.roles import CriticSpec, PlacedRoles, RayModelReward, role_specs
from tokenmill.controller.ray.workers import BackendSpec
from tokenmill.training.spec import TrainerSpec

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}, "algorithm": {"advantage": "gae", "kl_coef": 0.1},
        "critic": {"learning_rate": 3e-5}, "checkpoint": {"keep_last": 4}}


def _specs(roles: dict | None = None, **algorithm):
    cluster = {"backend": "ray", "cpus_per_node": 4, "trainer_ranks": 2, **({"roles": roles} if roles else {})}
    cfg = load_config(RLConfig, BASE | {"cluster": cluster, "algorithm": BASE["algorithm"] | algorithm})
    trainer = TrainerSpec.from_config(cfg, None)
    return cfg, role_specs(cfg, BackendSpec("m", "/shards", trainer=trainer))


def test_an_old_config_keeps_every_role_in_the_driver():
    _, (trainer, own, placements) = _specs()
    assert trainer.roles == ("policy",) and trainer.reference is None and trainer.critic is None and own == {}
    assert placements == {"reference": "driver", "critic": "driver", "reward_model": "none"}
    assert PlacedRoles(cluster=None, placements=placements).for_run() == {}


def test_roles_with_the_trainer_and_of_their_own():
    cfg, (trainer, own, placements) = _specs({"reference": {"placement": "with_trainer"},
                                              "critic": {"placement": "own", "ranks": 2}})
    assert trainer.roles == ("policy", "reference") and trainer.critic is None
    assert trainer.reference == TrainerSpec.from_config(cfg, None).reference_kwargs()
    assert list(own) == ["critic"] and own["critic"].roles == ("critic",) and own["critic"].reference is None
    critic = own["critic"].critic
    assert isinstance(critic, CriticSpec) and critic.keep == 5 and critic.kwargs["learning_rate"] == 3e-5
    groups = PlacedRoles(cluster=None, trainer="trainer group", own={"critic": "critic group"},
                         placements=placements).for_run()
    assert groups == {"reference": "trainer group", "critic": "critic group"}


def test_a_role_the_run_does_not_have_builds_nothing():
    _, (trainer, own, placements) = _specs({"reference": {"placement": "own"}, "critic": {"placement": "own"}},
                                           kl_coef=0.0, advantage="grpo")
    assert trainer.roles == ("policy",) and own == {} and placements["reference"] == placements["critic"] == "none"


def test_the_reward_model_actor_stands_in_for_each_model_reward():
    placed = PlacedRoles(cluster="cluster", placements={"reward_model": "own"}, reward_actor="actor")
    make = placed.for_run()["reward_model"]
    cfg = load_config(RLConfig, BASE | {"rewards": [{"type": "model", "path": "rms/helpful", "weight": 0.5}]})
    reward = make(cfg.rewards[0], 0, "rms/helpful")
    assert isinstance(reward, RayModelReward)
    assert (reward.name, reward.weight, reward.index, reward.actor) == ("helpful", 0.5, 0, "actor")
