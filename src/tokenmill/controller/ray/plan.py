"""The placement plan of a `cluster:` section: which trainer rank and which engine replica go on which node
and device. Computed from the config alone (nothing is started, Ray need not be installed), printed by
`tokenmill plan CONFIG`, and used to lay the actors out in the same order.

Rules (deterministic, so the printed plan is the one that runs):
- trainer ranks first: PACK fills node 0, then node 1, ...; SPREAD deals ranks out round-robin;
- disaggregated engines take the devices left, node by node, after the ranks;
- a colocated engine replica i shares trainer rank i's node and devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config.cluster import ClusterConfig
from tokenmill.types import ConfigError


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
