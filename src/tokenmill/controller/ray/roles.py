"""Where the KL reference, the PPO critic and the reward models run on Ray (`cluster.roles`), as verl's resource
pools and OpenRLHF's per-role nodes place them.

- `driver` (the default): in the driver process, unsharded, as the run has always done;
- `with_trainer`: FSDP2-sharded over the trainer ranks, in their processes (each rank holds 1/N of the
  weights and computes its rows of the global batch): no devices of its own;
- `own`: a worker group of its own (`roles.X.ranks` FSDP2 ranks on a placement group reserved after the
  trainer's), for a reference or a critic; one actor holding every `type: model` reward, for the reward model.

The driver's loop does not change: it holds a `RayReference` / `RayCritic` / `RayModelReward` with the methods of
the in-process object, each call going to the group (every rank gets the same global batch; the ranks split it).
A failed rank of any group raises `RankFailure`, and `train_on_ray` rebuilds every group and resumes the run
from its last checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.controller.ray.cluster import RayCluster, import_ray
from tokenmill.controller.ray.workers import BackendSpec, WorkerGroup, reserve


@dataclass(frozen=True)
class CriticSpec:
    """What a rank needs to build its shard of the critic: `critic:` of the config, the `Critic` keyword
    arguments (`controller.trainer.critic_kwargs`) and how many sharded saves to keep."""

    config: Any
    kwargs: dict[str, Any]
    keep: int = 3


def rank_reference(spec: BackendSpec, model: Any) -> Any:
    """This rank's shard of the frozen reference (inside the group's process group)."""
    from tokenmill.training.sharded import ShardedReference

    reference = ShardedReference(model, **spec.reference)
    spec.trainer.apply_fast_forward(reference.model)
    return reference


def rank_critic(spec: BackendSpec, device: Any) -> Any:
    """This rank's shard of the critic; its sharded checkpoints go beside the policy's."""
    from tokenmill.training.critic import load_critic
    from tokenmill.training.sharded import ShardedCritic

    c = spec.critic
    return ShardedCritic(load_critic(c.config, spec.model_path, device), checkpoint_dir=spec.checkpoint_dir,
                         keep=c.keep, **c.kwargs)


class RayReference:
    """The reference's `forward` on the driver, computed by the ranks of `group` (the trainer's or its own)."""

    model = None  # nothing in this process

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def forward(self, batch):
        return self.group.run("reference_forward", batch, what="reference forward")[0]


class RayCritic:
    """The critic's verbs on the driver (`values`, `forward_backward`, `optim_step`, `state_dict`,
    `load_state_dict`), run by the ranks of `group` (the trainer's or its own)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def _call(self, method: str, *args: Any) -> Any:
        return self.group.run("critic_call", method, *args, what=f"critic {method}")[0]

    def values(self, batch):
        return self._call("values", batch)

    def forward_backward(self, batch) -> dict[str, float]:
        return self._call("forward_backward", batch)

    def optim_step(self) -> dict[str, float]:
        return self._call("optim_step")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)


class RewardModelActor:
    """The body of the reward model actor: the run's `type: model` rewards, by index in `rewards:`."""

    def __init__(self, models: dict[int, dict[str, Any]]) -> None:
        from tokenmill.rewards.model import ModelReward

        self.models = {i: ModelReward(**kwargs) for i, kwargs in models.items()}

    def ready(self) -> dict[str, Any]:
        import os

        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def score(self, index: int, prompts, completions, columns, completion_ids=None) -> list:
        return self.models[index](prompts, completions, columns, completion_ids=completion_ids)


class RayModelReward:
    """A `type: model` reward scored by the reward model actor (`rewards.model.ModelReward`'s interface)."""

    def __init__(self, cluster: RayCluster, actor: Any, index: int, *, name: str, weight: float) -> None:
        self.cluster, self.actor, self.index, self.name, self.weight = cluster, actor, index, name, weight

    def __call__(self, prompts, completions, columns, *, completion_ids=None, state=None) -> list:
        return self.cluster.get(self.actor.score.remote(self.index, prompts, completions, columns, completion_ids),
                                what=f"reward model {self.name}")

    def close(self) -> None:
        pass


@dataclass
class PlacedRoles:
    """Every Ray worker group of a run: the trainer's, the groups of their own and the reward model actor.
    `for_run()` is what `build_run` takes (`role_groups`)."""

    cluster: RayCluster
    trainer: WorkerGroup | None = None
    own: dict[str, WorkerGroup] = field(default_factory=dict)  # "reference" / "critic"
    placements: dict[str, str] = field(default_factory=dict)  # role -> driver | with_trainer | own
    reward_actor: Any = None
    reward_pg: Any = None

    def groups(self) -> list[WorkerGroup]:
        return [g for g in (self.trainer, *self.own.values()) if g is not None]

    def for_run(self) -> dict[str, Any]:
        """role -> the group that computes it (reference, critic) or the factory of its rewards (reward_model)."""
        out: dict[str, Any] = {}
        for role in ("reference", "critic"):
            where = self.placements.get(role, "driver")
            if where == "with_trainer":
                out[role] = self.trainer
            elif where == "own":
                out[role] = self.own[role]
        if self.reward_actor is not None:
            def model_reward(rc: Any, index: int, path: str) -> RayModelReward:
                name = rc.name or path.rstrip("/").split("/")[-1]
                return RayModelReward(self.cluster, self.reward_actor, index, name=name, weight=rc.weight)

            out["reward_model"] = model_reward
        return out

    def rebuild(self) -> None:
        """New ranks for every group, on the same placement groups (a run resumes from its checkpoint after)."""
        for group in self.groups():
            group.rebuild()

    def close(self) -> None:
        ray = import_ray()
        for group in self.groups():
            group.close()
        if self.reward_actor is not None:
            ray.kill(self.reward_actor, no_restart=True)
        if self.reward_pg is not None:
            ray.util.remove_placement_group(self.reward_pg)


def role_specs(cfg: Any, spec: BackendSpec) -> tuple[BackendSpec, dict[str, BackendSpec], dict[str, str]]:
    """(the trainer ranks' spec, the spec of each group of its own, role -> placement) for the roles `cfg` has."""
    from dataclasses import replace

    from tokenmill.config.cluster import make_plan, roles_in_use
    from tokenmill.controller.trainer import critic_kwargs

    plan = make_plan(cfg.cluster, roles_in_use(cfg))
    placements = {role: plan.placement_of(role) for role in ("reference", "critic", "reward_model")}
    extra: dict[str, Any] = {}
    if placements["reference"] in ("with_trainer", "own"):
        extra["reference"] = spec.trainer.reference_kwargs()
    if placements["critic"] in ("with_trainer", "own"):
        extra["critic"] = CriticSpec(cfg.critic, critic_kwargs(cfg, spec.trainer), keep=cfg.checkpoint.keep_last + 1)
    with_trainer = tuple(r for r in ("reference", "critic") if placements[r] == "with_trainer")
    trainer = replace(spec, roles=("policy", *with_trainer), **{r: extra[r] for r in with_trainer})
    own = {r: replace(spec, roles=(r,), **{r: extra[r]}) for r in ("reference", "critic") if placements[r] == "own"}
    return trainer, own, placements


def reserve_all(cfg: Any, placements: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """The placement groups of the trainer, of each group of its own and of the reward model actor, reserved in
    the plan's order (before any engine starts, so that the engines take what the plan leaves them)."""
    c = cfg.cluster
    pgs = {"trainer": reserve(c.trainer_ranks, c.cpus_per_rank, c.rank_gpus, c.strategy, timeout_s)}
    try:
        for role in ("reference", "critic"):
            if placements[role] == "own":
                g = getattr(c.roles, role)
                pgs[role] = reserve(g.ranks, g.cpus_per_rank, g.gpus(c.gpus_per_node), g.strategy, timeout_s,
                                    role=role)
        if placements["reward_model"] == "own":
            rm = c.roles.reward_model
            pgs["reward_model"] = reserve(1, rm.cpus, rm.gpu_count(c.gpus_per_node), "PACK", timeout_s,
                                          role="reward model")
    except BaseException:
        ray = import_ray()
        for pg in pgs.values():
            ray.util.remove_placement_group(pg)
        raise
    return pgs


def start_roles(cfg: Any, cluster: RayCluster, spec: BackendSpec, placements: dict[str, str],
                own_specs: dict[str, BackendSpec], pgs: dict[str, Any]) -> PlacedRoles:
    """Start the trainer ranks, the groups of their own and the reward model actor on their placement groups."""
    c = cfg.cluster
    placed = PlacedRoles(cluster, placements=placements)
    try:
        placed.trainer = WorkerGroup(cluster, spec, c.trainer_ranks, gpus_per_rank=c.rank_gpus,
                                     start_timeout_s=c.start_timeout_s, pg=pgs.pop("trainer"))
        for role, role_spec in own_specs.items():
            g = getattr(c.roles, role)
            placed.own[role] = WorkerGroup(cluster, role_spec, g.ranks, gpus_per_rank=g.gpus(c.gpus_per_node),
                                           start_timeout_s=c.start_timeout_s, pg=pgs.pop(role), role=role)
        if "reward_model" in pgs:
            placed.reward_pg = pgs.pop("reward_model")
            placed.reward_actor = _reward_actor(cfg, cluster, placed.reward_pg)
    except BaseException:
        placed.close()
        ray = import_ray()
        for pg in pgs.values():
            ray.util.remove_placement_group(pg)
        raise
    return placed


def _reward_actor(cfg: Any, cluster: RayCluster, pg: Any) -> Any:
    ray = import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rm = cfg.cluster.roles.reward_model
    gpus = rm.gpu_count(cfg.cluster.gpus_per_node)
    models = {i: {"path": str(Path(rc.path)), "name": rc.name, "weight": rc.weight, "batch_size": rc.batch_size,
                  "device": "cuda" if gpus else "cpu"} for i, rc in enumerate(cfg.rewards) if rc.type == "model"}
    actor = ray.remote(RewardModelActor).options(
        num_cpus=0, num_gpus=gpus, max_restarts=0,  # the bundle holds the CPUs
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0),
    ).remote(models)
    cluster.get(actor.ready.remote(), timeout_s=cfg.cluster.start_timeout_s, what="starting the reward model actor")
    return actor
