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

from typing import Literal

from pydantic import Field, model_validator

from tokenmill.config.section import Section


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
