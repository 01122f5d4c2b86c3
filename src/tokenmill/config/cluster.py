"""`cluster:`: where trainer ranks and engine servers run when a run scales out on Ray.

The shape follows what verl and SkyRL users know: a node count and the devices of each node
(`trainer.nnodes`, `trainer.n_gpus_per_node` there), then how many of them each role takes.

    cluster:
      backend: ray
      address: null          # null: start a local cluster bound to 127.0.0.1; auto: join `ray start`'s; host:port
      nodes: 2
      gpus_per_node: 8
      trainer_ranks: 8       # one FSDP2 rank per GPU
      engine_replicas: 4     # `tokenmill serve` actors, 2 GPUs each
      gpus_per_engine: 2
      roles:                 # where the other models run (OpenRLHF's per-role nodes, verl's resource pools)
        reference: {placement: with_trainer}         # sharded over the trainer ranks
        critic: {placement: own, ranks: 2}           # a worker group of its own, FSDP2 over 2 ranks
        reward_model: {placement: own, gpus: 1}      # one actor
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from tokenmill.config.section import Section
from tokenmill.types import ConfigError

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RoleGroupConfig(Section):
    """Where the KL reference or the PPO critic runs on Ray: `driver` (unsharded, in the driver process: the
    default, what earlier versions did), `with_trainer` (FSDP2-sharded over the trainer ranks, in their
    processes: no devices of its own) or `own` (a worker group of its own: `ranks` FSDP2 ranks on devices of
    their own, placed after the trainer ranks)."""

    placement: Literal["driver", "with_trainer", "own"] = Field(
        "driver", description="driver: unsharded in the driver; with_trainer: sharded over the trainer ranks; "
        "own: a worker group of its own (`ranks` FSDP2 ranks).")
    ranks: int = Field(1, ge=1, description="own: ranks of its worker group (its weights are sharded over them).")
    cpus_per_rank: int = Field(1, ge=1, description="own: CPUs reserved for each of its ranks.")
    gpus_per_rank: int | None = Field(
        None, ge=0, description="own: GPUs of each of its ranks (default: 1 on a GPU cluster, else 0).")
    strategy: Strategy = Field("PACK", description="own: how its ranks are laid over the nodes (as cluster.strategy).")

    def gpus(self, gpus_per_node: int) -> int:
        return self.gpus_per_rank if self.gpus_per_rank is not None else int(gpus_per_node > 0)


class RewardModelPlacement(Section):
    """Where the `type: model` rewards run on Ray: `driver` (the default) or `own` (one actor holding them,
    which the driver's reward calls go to)."""

    placement: Literal["driver", "own"] = Field(
        "driver", description="driver: in the driver process; own: one Ray actor of `cpus` CPUs and `gpus` GPUs.")
    cpus: int = Field(1, ge=1, description="own: CPUs reserved for the reward model actor.")
    gpus: int | None = Field(None, ge=0, description="own: its GPUs (default: 1 on a GPU cluster, else 0).")

    def gpu_count(self, gpus_per_node: int) -> int:
        return self.gpus if self.gpus is not None else int(gpus_per_node > 0)


class ClusterRoles(Section):
    """Placement of each model besides the policy (the actor is always the trainer ranks; the engines are the
    driver's colocated engine, or `cluster.engine_replicas`)."""

    reference: RoleGroupConfig = Field(default_factory=RoleGroupConfig,
                                       description="The frozen KL reference (algorithm.kl_coef > 0).")
    critic: RoleGroupConfig = Field(default_factory=RoleGroupConfig,
                                    description="PPO's value model (algorithm.advantage: gae).")
    reward_model: RewardModelPlacement = Field(default_factory=RewardModelPlacement,
                                               description="The `type: model` rewards.")


class ClusterConfig(Section):
    """Placement of trainer ranks and engine replicas on a Ray cluster (`tokenmill plan` prints it)."""

    backend: Literal["local", "ray"] = Field(
        "local", description="local: this process (or the ranks torchrun started); ray: actors on a Ray cluster.")
    address: str | None = Field(
        None, description="Ray cluster to join: 'auto' (the one `ray start` runs on this machine) or 'host:port' "
        "of its GCS; null starts a local cluster bound to 127.0.0.1 with no dashboard.")
    nodes: int = Field(1, ge=1, description="Nodes the plan lays out (a joined cluster must have at least these).")
    cpus_per_node: int = Field(2, ge=1, description="CPUs of each node the plan may use.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs of each node (0: a CPU cluster, gloo collectives).")
    trainer_ranks: int = Field(1, ge=1, description="Trainer processes (FSDP2 ranks), one Ray actor each.")
    cpus_per_rank: int = Field(1, ge=1, description="CPUs reserved for each trainer rank.")
    gpus_per_rank: int | None = Field(
        None, ge=0, description="GPUs of each trainer rank (default: 1 on a GPU cluster, else 0).")
    engine_replicas: int = Field(
        0, ge=0, description="`tokenmill serve` engine servers started as Ray actors (0: none).")
    cpus_per_engine: int = Field(1, ge=1, description="CPUs reserved for each engine replica.")
    gpus_per_engine: int | None = Field(
        None, ge=0, description="GPUs of each engine replica (default: 1 on a GPU cluster, else 0).")
    colocate: bool = Field(
        False, description="Engine replica i shares trainer rank i's node and devices (the trainer and the "
        "engine take turns); else the engines get devices of their own (disaggregated).")
    strategy: Strategy = Field(
        "PACK", description="How trainer ranks are laid over nodes (Ray placement-group strategy): PACK fills a "
        "node before the next, SPREAD deals ranks out round-robin; STRICT_ forms refuse to do otherwise.")
    max_restarts: int = Field(
        2, ge=0, description="Times the trainer group is rebuilt from the last checkpoint after a rank dies.")
    call_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for any call to a trainer rank or engine actor.")
    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the actors (and their servers) to start.")
    roles: ClusterRoles = Field(default_factory=ClusterRoles, description="Where the reference, the critic and "
                                "the reward models run (each in the driver unless placed here).")
    replica_wait_s: float = Field(
        300.0, ge=0, description="When no engine replica is left, how long a weight push or a request waits for "
        "a replacement before the run stops (0: stop at once).")
    weight_sync: Literal["files", "broadcast"] = Field(
        "files", description="How new weights reach the engine replicas: files (rank 0's weights through the driver "
        "to a safetensors folder every replica reads) or broadcast (trainer rank 0 broadcasts them in packed "
        "buckets over a torch.distributed group with the replicas and the driver: gloo on CPU, NCCL on GPU).")

    @property
    def rank_gpus(self) -> int:
        return self.gpus_per_rank if self.gpus_per_rank is not None else int(self.gpus_per_node > 0)

    @property
    def engine_gpus(self) -> int:
        return self.gpus_per_engine if self.gpus_per_engine is not None else int(self.gpus_per_node > 0)

    @model_validator(mode="after")
    def _fits(self) -> ClusterConfig:
        for role, cpus, gpus in (("rank", self.cpus_per_rank, self.rank_gpus),
                                 ("engine", self.cpus_per_engine, self.engine_gpus)):
            if cpus > self.cpus_per_node:
                raise ValueError(f"cluster.cpus_per_{role}: {cpus} exceeds cluster.cpus_per_node "
                                 f"({self.cpus_per_node}); one {role} must fit on one node")
            if gpus > self.gpus_per_node:
                raise ValueError(f"cluster.gpus_per_{role}: {gpus} exceeds cluster.gpus_per_node "
                                 f"({self.gpus_per_node}); one {role} must fit on one node")
        if self.colocate and self.engine_replicas > self.trainer_ranks:
            raise ValueError(f"cluster.engine_replicas: colocated engines share a trainer rank's devices, so at "
                             f"most cluster.trainer_ranks ({self.trainer_ranks}), got {self.engine_replicas}")
        if self.colocate and self.engine_gpus > self.rank_gpus:
            raise ValueError(f"cluster.gpus_per_engine: a colocated engine uses its rank's {self.rank_gpus} GPU(s), "
                             f"got {self.engine_gpus}")
        if self.address is not None and self.address != "auto" and ":" not in self.address:
            raise ValueError(f"cluster.address: 'auto', 'host:port' or null, got {self.address!r}")
        self._roles_fit()
        if self.backend == "local" and (self.engine_replicas or self.trainer_ranks > 1 or self.nodes > 1):
            raise ValueError("cluster.backend: trainer_ranks, engine_replicas and nodes are laid out by Ray; set "
                             "cluster.backend: ray (torchrun takes its rank count from --nproc_per_node)")
        return self

    def _roles_fit(self) -> None:
        r = self.roles
        for name, role in (("reference", r.reference), ("critic", r.critic)):
            if role.placement != "own":
                continue
            if role.cpus_per_rank > self.cpus_per_node:
                raise ValueError(f"cluster.roles.{name}.cpus_per_rank: {role.cpus_per_rank} exceeds "
                                 f"cluster.cpus_per_node ({self.cpus_per_node}); one rank must fit on one node")
            if role.gpus(self.gpus_per_node) > self.gpus_per_node:
                raise ValueError(f"cluster.roles.{name}.gpus_per_rank: {role.gpus(self.gpus_per_node)} exceeds "
                                 f"cluster.gpus_per_node ({self.gpus_per_node}); one rank must fit on one node")
        rm = r.reward_model
        if rm.placement == "own" and (rm.cpus > self.cpus_per_node or rm.gpu_count(self.gpus_per_node) > self.gpus_per_node):
            raise ValueError(f"cluster.roles.reward_model: CPU {rm.cpus}, GPU {rm.gpu_count(self.gpus_per_node)} "
                             f"exceed one node (CPU {self.cpus_per_node}, GPU {self.gpus_per_node})")
        placed = [f"roles.{n}" for n, p in (("reference", r.reference.placement), ("critic", r.critic.placement),
                                            ("reward_model", r.reward_model.placement)) if p != "driver"]
        if self.backend == "local" and placed:
            raise ValueError(f"cluster.{placed[0]}.placement: placing a role needs cluster.backend: ray")


# ------------------------------------------------------------------------------------------ the plan
# The placement plan of a `cluster:` section: which trainer rank, role rank and engine replica go on which node
# and device. Computed from the config alone (nothing is started, Ray need not be installed), printed by
# `tokenmill plan CONFIG`. It is the intended layout: Ray schedules the actors itself, with the same strategy
# (one placement group per worker group, reserved in this order before any engine starts).
#
# Rules:
# - trainer ranks first: PACK fills node 0, then node 1, ...; SPREAD deals ranks out round-robin;
# - then the groups of their own (reference, critic: `roles.X.placement: own`), with their own strategy, then a
#   reward model actor of its own, on what is left;
# - disaggregated engines take the devices left, node by node, after those;
# - a colocated engine replica i shares trainer rank i's node and devices.

ROLES = ("reference", "critic", "reward_model")  # the models placed by `cluster.roles`
ROLE_NAMES = {"trainer": "trainer rank", "reference": "reference rank", "critic": "critic rank",
              "reward_model": "reward model", "engine": "engine replica"}


LOCAL_GPUS = ("cluster.address: null starts every node on this machine, where they would share its GPUs; `tokenmill "
              "train` refuses it: start one node per machine (`ray start`) and set cluster.address")


def shares_local_gpus(cfg: ClusterConfig) -> bool:
    """A local cluster of several nodes with GPUs: the nodes would all hand out this machine's GPU 0, 1, ..."""
    return cfg.address is None and cfg.nodes > 1 and cfg.gpus_per_node > 0


def roles_in_use(cfg: Any) -> set[str]:
    """The roles an RL config has: a reference with `algorithm.kl_coef` > 0, a critic with GAE, a reward model
    with a `type: model` reward."""
    used = set()
    if cfg.algorithm.kl_coef > 0:
        used.add("reference")
    if cfg.algorithm.advantage == "gae":
        used.add("critic")
    if any(getattr(rc, "type", None) == "model" for rc in cfg.rewards):
        used.add("reward_model")
    return used


@dataclass(frozen=True)
class Slot:
    role: str  # "trainer", "reference", "critic", "reward_model" or "engine"
    index: int  # rank, or replica number
    node: int
    cpus: int
    gpus: tuple[int, ...]  # GPU indices on the node; () on CPU

    @property
    def device(self) -> str:
        return ",".join(f"cuda:{g}" for g in self.gpus) if self.gpus else "cpu"


@dataclass
class _Node:
    cpus: int
    gpus: list[int] = field(default_factory=list)  # free GPU indices

    def fits(self, cpus: int, gpus: int) -> bool:
        return self.cpus >= cpus and len(self.gpus) >= gpus

    def take(self, cpus: int, gpus: int) -> tuple[int, ...]:
        self.cpus -= cpus
        taken, self.gpus = tuple(self.gpus[:gpus]), self.gpus[gpus:]
        return taken


@dataclass
class Plan:
    cfg: ClusterConfig
    slots: list[Slot]
    free: list[tuple[int, int]]  # (cpus, gpus) left on each node
    used: set[str] = field(default_factory=lambda: set(ROLES))  # the roles the run has

    def trainer_nodes(self) -> list[int]:
        return [s.node for s in self.slots if s.role == "trainer"]

    def placement_of(self, role: str) -> str:
        """`driver`, `with_trainer`, `own`, or `none` (the run has no such model)."""
        if role not in self.used:
            return "none"
        r = self.cfg.roles
        return {"reference": r.reference.placement, "critic": r.critic.placement,
                "reward_model": r.reward_model.placement}[role]

    def summary(self) -> dict:
        """Devices per role, ranks and replicas, and the printed lines (the memory estimate shows them)."""
        def devices(role: str) -> list[str]:
            return [f"node {s.node} {s.device}" for s in self.slots if s.role == role]

        return {"nodes": self.cfg.nodes, "trainer_ranks": self.cfg.trainer_ranks,
                "engine_replicas": self.cfg.engine_replicas, "colocate": self.cfg.colocate,
                "trainer_devices": devices("trainer"), "engine_devices": devices("engine"), "lines": self.lines()}

    def layout(self) -> dict:
        """Every node with what runs on it (the Composer draws it), and where each role runs."""
        nodes = [{"node": i, "cpus": self.cfg.cpus_per_node, "gpus": self.cfg.gpus_per_node, "free_cpus": c,
                  "free_gpus": g, "slots": []} for i, (c, g) in enumerate(self.free)]
        for s in sorted(self.slots, key=_slot_order):
            nodes[s.node]["slots"].append({"role": s.role, "index": s.index, "name": f"{ROLE_NAMES[s.role]} "
                                           f"{s.index}", "device": s.device, "cpus": s.cpus})
        return {"nodes": nodes, "roles": [{"role": name, "where": where} for name, where in self.role_lines()]}

    def role_lines(self) -> list[tuple[str, str]]:
        c = self.cfg
        ranks = _span("trainer rank", c.trainer_ranks)
        out = [("actor", f"{ranks} (FSDP2 over {c.trainer_ranks})")]
        for role in ("reference", "critic"):
            where = self.placement_of(role)
            group = getattr(c.roles, role)
            out.append((role, {
                "none": "none in this run",
                "driver": "the driver process (unsharded)",
                "with_trainer": f"sharded over {ranks} (in their processes)",
                "own": f"a worker group of its own: {_span(role + ' rank', group.ranks)} (FSDP2 over {group.ranks})",
            }[where]))
        rm = {"none": "none in this run", "driver": "the driver process",
              "own": "an actor of its own (reward model 0)"}[self.placement_of("reward_model")]
        out.append(("reward model", rm))
        engines = (_span("engine replica", c.engine_replicas) + (" (colocated with the trainer ranks)"
                   if c.colocate else "") if c.engine_replicas else "the driver's colocated engine")
        out.append(("engines", engines))
        return out

    def lines(self) -> list[str]:
        c = self.cfg
        local = f"a local cluster of {c.nodes} nodes" if c.nodes > 1 else "a local cluster"
        where = {None: f"start {local} on 127.0.0.1 (no dashboard)",
                 "auto": "join the cluster on this machine (address: auto)"}.get(c.address,
                                                                               f"join the cluster at {c.address}")
        engines = ("none" if not c.engine_replicas else
                   f"{c.engine_replicas} x (CPU {c.cpus_per_engine}, GPU {c.engine_gpus}), "
                   + ("colocated with the trainer ranks" if c.colocate else "on devices of their own"))
        out = [f"cluster: ray, {where}",
               f"nodes: {c.nodes} x (CPU {c.cpus_per_node}, GPU {c.gpus_per_node})",
               (f"trainer: {c.trainer_ranks} rank(s) x (CPU {c.cpus_per_rank}, GPU {c.rank_gpus}), "
               f"strategy {c.strategy}, max_restarts {c.max_restarts}"),
               f"engines: {engines}"]
        for s in sorted(self.slots, key=_slot_order):
            out.append(f"  node {s.node}  {ROLE_NAMES[s.role] + ' ' + str(s.index):<18} {s.device:<14} CPU {s.cpus}")
        out.append("free: " + "; ".join(f"node {i}: CPU {cpu}, GPU {gpu}" for i, (cpu, gpu) in enumerate(self.free)))
        out.append("roles:")
        out += [f"  {name:<13} {where}" for name, where in self.role_lines()]
        if shares_local_gpus(c):
            out.append(f"note: {LOCAL_GPUS}")
        return out


def _slot_order(s: Slot) -> tuple:
    return s.node, ("trainer", "reference", "critic", "reward_model", "engine").index(s.role), s.index


def _span(what: str, n: int) -> str:
    return f"{what} 0" if n == 1 else f"{what}s 0-{n - 1}"


def _order(strategy: str, rank: int, nodes: int) -> list[int]:
    if strategy in ("SPREAD", "STRICT_SPREAD"):
        return [(rank + k) % nodes for k in range(nodes)]
    return [0] if strategy == "STRICT_PACK" else list(range(nodes))


def _place_group(nodes: list[_Node], role: str, count: int, cpus: int, gpus: int, strategy: str,
                 field_name: str) -> list[Slot]:
    """`count` ranks of (cpus, gpus) over `nodes` by `strategy`; a ConfigError names `field_name` otherwise.
    STRICT_PACK puts the whole group on one node (the first that holds it), STRICT_SPREAD each rank on a node
    of its own."""
    home = None
    if strategy == "STRICT_PACK":  # one node for the whole group, as Ray's STRICT_PACK
        home = next((i for i, n in enumerate(nodes) if n.fits(cpus * count, gpus * count)), 0)
    slots: list[Slot] = []
    taken: set[int] = set()
    for rank in range(count):
        order = [home] if home is not None else _order(strategy, rank, len(nodes))
        candidates = [i for i in order if nodes[i].fits(cpus, gpus)]
        if strategy == "STRICT_SPREAD":
            candidates = [i for i in candidates if i not in taken]
        if not candidates:
            why = ("STRICT_SPREAD puts each rank on a node of its own and no other node has that left"
                   if strategy == "STRICT_SPREAD" else "no node has that left")
            raise ConfigError(f"{field_name}: {ROLE_NAMES[role]} {rank} does not fit ({count} ranks x (CPU "
                              f"{cpus}, GPU {gpus}), strategy {strategy}; {why}; the nodes have "
                              + "; ".join(f"CPU {n.cpus}, GPU {len(n.gpus)}" for n in nodes) + " left)")
        node = candidates[0]
        taken.add(node)
        slots.append(Slot(role, rank, node, cpus, nodes[node].take(cpus, gpus)))
    return slots


def make_plan(cfg: ClusterConfig, used: set[str] | None = None) -> Plan:
    """Lay the ranks, the roles of their own and the engines out on `cfg.nodes` nodes (`used`: the roles the run
    has, see `roles_in_use`; None: every role placed in `cfg.roles`); a ConfigError names what does not fit."""
    used = set(ROLES) if used is None else used
    nodes = [_Node(cfg.cpus_per_node, list(range(cfg.gpus_per_node))) for _ in range(cfg.nodes)]
    slots = _place_trainer(cfg, nodes)
    for role in ("reference", "critic"):
        group = getattr(cfg.roles, role)
        if role in used and group.placement == "own":
            slots += _place_group(nodes, role, group.ranks, group.cpus_per_rank, group.gpus(cfg.gpus_per_node),
                                  group.strategy, f"cluster.roles.{role}")
    rm = cfg.roles.reward_model
    if "reward_model" in used and rm.placement == "own":
        slots += _place_group(nodes, "reward_model", 1, rm.cpus, rm.gpu_count(cfg.gpus_per_node), "PACK",
                              "cluster.roles.reward_model")
    slots += _place_engines(cfg, nodes, slots)
    return Plan(cfg, slots, [(n.cpus, len(n.gpus)) for n in nodes], used)


def _place_trainer(cfg: ClusterConfig, nodes: list[_Node]) -> list[Slot]:
    slots: list[Slot] = []
    per_engine_cpus = 0 if cfg.colocate else cfg.cpus_per_engine
    for rank in range(cfg.trainer_ranks):
        order = _order(cfg.strategy, rank, cfg.nodes)
        cpus = cfg.cpus_per_rank + (per_engine_cpus if cfg.colocate and rank < cfg.engine_replicas else 0)
        node = next((i for i in order if nodes[i].fits(cpus, cfg.rank_gpus)), None)
        if node is None or (cfg.strategy == "STRICT_SPREAD" and rank >= cfg.nodes):
            raise ConfigError(f"cluster: trainer rank {rank} does not fit ({cfg.trainer_ranks} ranks x (CPU "
                              f"{cfg.cpus_per_rank}, GPU {cfg.rank_gpus}) on {cfg.nodes} node(s) x (CPU "
                              f"{cfg.cpus_per_node}, GPU {cfg.gpus_per_node}), strategy {cfg.strategy})")
        gpus = nodes[node].take(cfg.cpus_per_rank, cfg.rank_gpus)
        slots.append(Slot("trainer", rank, node, cfg.cpus_per_rank, gpus))
    return slots


def _place_engines(cfg: ClusterConfig, nodes: list[_Node], placed: list[Slot]) -> list[Slot]:
    slots: list[Slot] = []
    for replica in range(cfg.engine_replicas):
        if cfg.colocate:  # on its rank's devices; its CPUs come from the same node
            rank = placed[replica]
            if not nodes[rank.node].fits(cfg.cpus_per_engine, 0):
                raise ConfigError(f"cluster: colocated engine replica {replica} needs CPU {cfg.cpus_per_engine} "
                                  f"more on node {rank.node}")
            nodes[rank.node].take(cfg.cpus_per_engine, 0)
            slots.append(Slot("engine", replica, rank.node, cfg.cpus_per_engine, rank.gpus[:cfg.engine_gpus]))
            continue
        node = next((i for i in range(cfg.nodes) if nodes[i].fits(cfg.cpus_per_engine, cfg.engine_gpus)), None)
        if node is None:
            raise ConfigError(f"cluster: engine replica {replica} does not fit: after the trainer ranks, the nodes "
                              "have " + "; ".join(f"CPU {n.cpus}, GPU {len(n.gpus)}" for n in nodes)
                              + f" left, a replica needs CPU {cfg.cpus_per_engine}, GPU {cfg.engine_gpus}")
        gpus = nodes[node].take(cfg.cpus_per_engine, cfg.engine_gpus)
        slots.append(Slot("engine", replica, node, cfg.cpus_per_engine, gpus))
    return slots


def placement_of_config(config: dict) -> dict:
    """The plan of an RL config given as a plain dict (`mode` and `estimate` keys allowed), for the memory
    estimate and the Composer: `Plan.summary()` plus `layout` (nodes with their slots, where each role runs)."""
    from tokenmill.config import RLConfig, load_config

    cfg = load_config(RLConfig, {k: v for k, v in config.items() if k not in ("mode", "estimate")})
    plan = make_plan(cfg.cluster, roles_in_use(cfg))
    return plan.summary() | {"layout": plan.layout()}
