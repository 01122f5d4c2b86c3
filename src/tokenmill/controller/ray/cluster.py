"""Start or join a Ray cluster with safe defaults, and wait on remote calls with a limit.

Ray's own defaults are wrong for a training library on a shared machine: a local `ray.init()` on Linux
resolves 127.0.0.1 to the first network interface's address and binds its GCS, raylet and workers on all
interfaces, it reports usage statistics, and with `ray[default]` it starts a dashboard whose job API runs
arbitrary code for whoever reaches it. A local cluster here therefore:

- binds every process to 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, the switch Ray itself uses on
  single-machine macOS/Windows; set before Ray starts, so every Ray process inherits it),
- starts no dashboard and sends no usage statistics,
- keeps Ray's token authentication on (Ray 2.60 turns it on by default).

Joining an existing cluster (`cluster.address: auto` or `host:port`) changes none of that cluster's settings;
how to start one safely is in docs/scale-out.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.types import TokenmillError

log = logging.getLogger("tokenmill.controller.ray")

# set in this process before Ray starts: the raylet, GCS and workers inherit them
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node ip 127.0.0.1, every socket on loopback
    "RAY_USAGE_STATS_ENABLED": "0",
}
LOOPBACK = "127.0.0.1"


class ClusterError(TokenmillError):
    """Ray is missing, a cluster could not be started or joined, or a remote call failed or ran out of time."""


def import_ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the installed extras
        raise ClusterError("cluster.backend ray needs Ray: pip install 'tokenmill[ray]'") from None
    return ray


def local_node_args(num_cpus: float, num_gpus: float = 0, temp_dir: str | None = None) -> dict[str, Any]:
    """Keyword arguments for a loopback-only Ray node (`ray.init` or `ray.cluster_utils.Cluster.add_node`)."""
    args: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "include_dashboard": False,
                            "node_ip_address": LOOPBACK}
    if temp_dir:
        args["temp_dir"] = temp_dir
    return args


def set_local_env() -> None:
    """Put the loopback and no-telemetry switches in this process's environment (before Ray starts)."""
    os.environ.update(LOCAL_ENV)


@dataclass
class RayCluster:
    """A connection to a Ray cluster: one this process started (`started`, shut down by `close`) or joined."""

    address: str  # the GCS address
    started: bool
    call_timeout_s: float = 300.0
    node_ids: list[str] = field(default_factory=list)
    local_nodes: Any = None  # the `ray.cluster_utils.Cluster` of a local multi-node cluster this process started

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the local nodes (their processes are this process's): a copy only reaches the cluster."""
        return {**self.__dict__, "local_nodes": None}

    def get(self, refs, *, timeout_s: float | None = None, what: str = "remote call"):
        """`ray.get` with a limit: never wait on a remote call without one (a dead peer of a collective hangs
        the live ranks until their process-group timeout)."""
        ray = import_ray()
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"{what}: no answer within {limit:g} s (cluster.call_timeout_s)") from None

    def nodes(self) -> list[dict[str, Any]]:
        """The live nodes: id, address and resources, head first, then by address (a stable order)."""
        ray = import_ray()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        head = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
        rows = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "resources": dict(n["Resources"]),
                 "is_head": "node:__internal_head__" in n["Resources"]} for n in alive]
        rows.sort(key=lambda r: (not r["is_head"], r["address"] != head, r["address"], r["node_id"]))
        return rows

    def close(self) -> None:
        ray = import_ray()
        if ray.is_initialized():
            ray.shutdown()
        if self.local_nodes is not None:
            self.local_nodes.shutdown()
            self.local_nodes = None

    def check_plan(self, cfg: Any) -> None:
        """Refuse, before anything starts, a `cluster:` section this cluster cannot hold: fewer live nodes with
        `cluster.cpus_per_node` CPUs and `cluster.gpus_per_node` GPUs than `cluster.nodes` (Ray would wait for
        the placement groups until `cluster.start_timeout_s`)."""
        live = [n["resources"] for n in self.nodes()]
        enough = [r for r in live if r.get("CPU", 0) >= cfg.cpus_per_node and r.get("GPU", 0) >= cfg.gpus_per_node]
        if len(enough) < cfg.nodes:
            have = "; ".join(f"CPU {r.get('CPU', 0):g}, GPU {r.get('GPU', 0):g}" for r in live)
            raise ClusterError(f"cluster.nodes: the plan lays out {cfg.nodes} node(s) x (CPU {cfg.cpus_per_node}, "
                               f"GPU {cfg.gpus_per_node}); the cluster at {self.address} has {len(enough)} such "
                               f"node(s) ({len(live)} live: {have})")


def _check_loopback(ray) -> None:
    """Ray reads the loopback switch once, when it is imported: refuse a local start if it was imported
    without it (it would bind the node to the first network interface)."""
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise ClusterError("a local Ray cluster must bind 127.0.0.1 only, but Ray was imported before "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; call "
                           "tokenmill.controller.ray.cluster.set_local_env() before `import ray`")


def start_local_nodes(nodes: int, num_cpus: float, num_gpus: float = 0, temp_dir: str | None = None,
                      timeout_s: float = 120.0) -> Any:
    """`nodes` loopback-only Ray nodes on this machine, `num_cpus` CPUs and `num_gpus` GPUs each (Ray's own
    `ray.cluster_utils.Cluster`: one GCS, one raylet per node): a placement over nodes runs as it would on as
    many machines. Returns the Cluster (its `address` to join; `shutdown()` stops every node)."""
    ray = import_ray()
    _check_loopback(ray)
    from ray.cluster_utils import Cluster

    local = Cluster(initialize_head=True, head_node_args=local_node_args(num_cpus, num_gpus, temp_dir))
    try:
        for _ in range(nodes - 1):
            local.add_node(**local_node_args(num_cpus, num_gpus, temp_dir))
        local.wait_for_nodes(timeout=timeout_s)
    except BaseException:
        local.shutdown()
        raise
    return local


def connect(address: str | None, *, num_cpus: float | None = None, num_gpus: float = 0,
            call_timeout_s: float = 300.0, start_timeout_s: float = 120.0, temp_dir: str | None = None,
            nodes: int = 1) -> RayCluster:
    """Join the cluster at `address` ("auto": the one `ray start` runs on this machine; "host:port": its GCS),
    or with `address=None` start a local loopback-only cluster of `num_cpus` CPUs (default: this machine's);
    with `nodes` > 1, of that many nodes of `num_cpus` CPUs and `num_gpus` GPUs each (`start_local_nodes`)."""
    if address is None and "ray" not in sys.modules:  # Ray reads the loopback switch once, at import
        set_local_env()
    ray = import_ray()
    if ray.is_initialized():
        raise ClusterError("Ray is already initialised in this process; close the other cluster connection first")
    t0 = time.monotonic()
    local = None
    if address is None and nodes > 1:
        local = start_local_nodes(nodes, num_cpus if num_cpus is not None else 1, num_gpus, temp_dir,
                                  timeout_s=start_timeout_s)
        try:
            ray.init(address=local.address, log_to_driver=False, configure_logging=False)
        except BaseException:
            local.shutdown()
            raise
    elif address is None:
        _check_loopback(ray)
        args = local_node_args(num_cpus if num_cpus is not None else (os.cpu_count() or 1), num_gpus, temp_dir)
        args["_node_ip_address"] = args.pop("node_ip_address")
        if "temp_dir" in args:
            args["_temp_dir"] = args.pop("temp_dir")
        ray.init(**args, log_to_driver=False, configure_logging=False)
    else:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # this driver never reports usage, whatever the cluster does
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"cluster.address {address!r}: cannot join the Ray cluster: {exc}") from None
    gcs = ray.get_runtime_context().gcs_address
    cluster = RayCluster(gcs, started=address is None, call_timeout_s=call_timeout_s, local_nodes=local)
    cluster.node_ids = [n["node_id"] for n in cluster.nodes()]
    log.info("ray cluster %s %s in %.1f s: %d node(s)", gcs, "started" if cluster.started else "joined",
             time.monotonic() - t0, len(cluster.node_ids))
    return cluster

