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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, model_validator

from tokenmill.config.section import Section
from tokenmill.types import ConfigError


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
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How trainer ranks are laid over nodes (Ray placement-group strategy): PACK fills a "
        "node before the next, SPREAD deals ranks out round-robin; STRICT_ forms refuse to do otherwise.")
    max_restarts: int = Field(
        2, ge=0, description="Times the trainer group is rebuilt from the last checkpoint after a rank dies.")
    call_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for any call to a trainer rank or engine actor.")
    start_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for the actors (and their servers) to start.")
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
        if self.backend == "local" and (self.engine_replicas or self.trainer_ranks > 1 or self.nodes > 1):
            raise ValueError("cluster.backend: trainer_ranks, engine_replicas and nodes are laid out by Ray; set "
                             "cluster.backend: ray (torchrun takes its rank count from --nproc_per_node)")
        return self


# ------------------------------------------------------------------------------------------ the plan
# The placement plan of a `cluster:` section: which trainer rank and which engine replica go on which node
# and device. Computed from the config alone (nothing is started, Ray need not be installed), printed by
# `tokenmill plan CONFIG`. It is the intended layout: Ray schedules the actors itself, with the same strategy
# (one placement group per trainer group).
#
# Rules:
# - trainer ranks first: PACK fills node 0, then node 1, ...; SPREAD deals ranks out round-robin;
# - disaggregated engines take the devices left, node by node, after the ranks;
# - a colocated engine replica i shares trainer rank i's node and devices.


@dataclass(frozen=True)
class Slot:
    role: str  # "trainer" or "engine"
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

    def trainer_nodes(self) -> list[int]:
        return [s.node for s in self.slots if s.role == "trainer"]

    def summary(self) -> dict:
        """Devices per role, ranks and replicas, and the printed lines (the memory estimate shows them)."""
        def devices(role: str) -> list[str]:
            return [f"node {s.node} {s.device}" for s in self.slots if s.role == role]

        return {"nodes": self.cfg.nodes, "trainer_ranks": self.cfg.trainer_ranks,
                "engine_replicas": self.cfg.engine_replicas, "colocate": self.cfg.colocate,
                "trainer_devices": devices("trainer"), "engine_devices": devices("engine"), "lines": self.lines()}

    def lines(self) -> list[str]:
        c = self.cfg
        where = {None: "start a local cluster on 127.0.0.1 (no dashboard)", "auto": "join the cluster on this "
                 "machine (address: auto)"}.get(c.address, f"join the cluster at {c.address}")
        engines = ("none" if not c.engine_replicas else
                   f"{c.engine_replicas} x (CPU {c.cpus_per_engine}, GPU {c.engine_gpus}), "
                   + ("colocated with the trainer ranks" if c.colocate else "on devices of their own"))
        out = [f"cluster: ray, {where}",
               f"nodes: {c.nodes} x (CPU {c.cpus_per_node}, GPU {c.gpus_per_node})",
               (f"trainer: {c.trainer_ranks} rank(s) x (CPU {c.cpus_per_rank}, GPU {c.rank_gpus}), "
               f"strategy {c.strategy}, max_restarts {c.max_restarts}"),
               f"engines: {engines}"]
        for s in sorted(self.slots, key=lambda s: (s.node, s.role != "trainer", s.index)):
            name = f"trainer rank {s.index}" if s.role == "trainer" else f"engine replica {s.index}"
            out.append(f"  node {s.node}  {name:<18} {s.device:<14} CPU {s.cpus}")
        out.append("free: " + "; ".join(f"node {i}: CPU {cpu}, GPU {gpu}" for i, (cpu, gpu) in enumerate(self.free)))
        return out


def make_plan(cfg: ClusterConfig) -> Plan:
    """Lay the ranks and engines out on `cfg.nodes` nodes; a ConfigError names what does not fit."""
    nodes = [_Node(cfg.cpus_per_node, list(range(cfg.gpus_per_node))) for _ in range(cfg.nodes)]
    slots: list[Slot] = []
    per_engine_cpus = 0 if cfg.colocate else cfg.cpus_per_engine
    for rank in range(cfg.trainer_ranks):
        order = range(cfg.nodes)
        if cfg.strategy in ("SPREAD", "STRICT_SPREAD"):
            order = [(rank + k) % cfg.nodes for k in range(cfg.nodes)]
        if cfg.strategy == "STRICT_PACK":
            order = [0]
        cpus = cfg.cpus_per_rank + (per_engine_cpus if cfg.colocate and rank < cfg.engine_replicas else 0)
        node = next((i for i in order if nodes[i].fits(cpus, cfg.rank_gpus)), None)
        if node is None or (cfg.strategy == "STRICT_SPREAD" and rank >= cfg.nodes):
            raise ConfigError(f"cluster: trainer rank {rank} does not fit ({cfg.trainer_ranks} ranks x (CPU "
                              f"{cfg.cpus_per_rank}, GPU {cfg.rank_gpus}) on {cfg.nodes} node(s) x (CPU "
                              f"{cfg.cpus_per_node}, GPU {cfg.gpus_per_node}), strategy {cfg.strategy})")
        gpus = nodes[node].take(cfg.cpus_per_rank, cfg.rank_gpus)
        slots.append(Slot("trainer", rank, node, cfg.cpus_per_rank, gpus))
    for replica in range(cfg.engine_replicas):
        if cfg.colocate:  # on its rank's devices; its CPUs come from the same node
            rank = slots[replica]
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
    return Plan(cfg, slots, [(n.cpus, len(n.gpus)) for n in nodes])
