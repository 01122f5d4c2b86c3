"""One two-node Ray cluster for the whole test session, every process on 127.0.0.1.

The two "nodes" are two raylets on this machine (`ray.cluster_utils.Cluster`, Ray's own test utility), so
placement across nodes is exercised; `tokenmill.controller.ray.connect(None, nodes=2)` starts them, the path
a run with `cluster.address: null, nodes: 2` takes. Skipped where Ray is not installed (`pip install 'tokenmill[ray]'`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tokenmill.controller.ray.cluster import set_local_env

set_local_env()  # before Ray is imported: Ray reads the loopback switch once, at import
ray = pytest.importorskip("ray")

CPUS_PER_NODE = 3  # logical CPUs: a scheduling budget, not cores (the machine may have 2)


@pytest.fixture(scope="session")
def ray_cluster():
    from ray._private import ray_constants

    from tokenmill.controller.ray.cluster import connect

    assert not ray_constants.ENABLE_RAY_CLUSTER  # never start nodes that bind the network interface
    # a short private temp dir: Ray's unix socket paths must stay under 107 characters
    temp = tempfile.mkdtemp(prefix="tmray", dir="/tmp")
    # Ray's address file and sessions go here too, not to the machine-wide /tmp/ray that `address: auto` reads
    os.environ["RAY_TMPDIR"] = temp
    os.makedirs(os.path.join(temp, "ray"))
    # what `cluster.address: null, nodes: 2` starts: two raylets (Ray's `cluster_utils.Cluster`), joined
    cluster = connect(None, nodes=2, num_cpus=CPUS_PER_NODE, call_timeout_s=120.0, start_timeout_s=60.0)
    try:
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def listening_sockets():
    return _listening_sockets


def _listening_sockets() -> list[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of every listening TCP socket of this process and all its descendants: the
    cluster's GCS, raylets, agents and workers are all started under the test process."""
    import psutil

    me = psutil.Process(os.getpid())
    out = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            for conn in proc.net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append((proc.pid, proc.name(), conn.laddr.ip.removeprefix("::ffff:"), conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out
