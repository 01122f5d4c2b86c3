"""The local Ray cluster: loopback only, no dashboard, two nodes, limited waits."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


def test_every_listening_socket_of_the_cluster_is_on_loopback(ray_cluster, listening_sockets):
    @ray.remote(num_cpus=1)
    def ping():
        return 1

    assert ray_cluster.get([ping.remote() for _ in range(4)]) == [1, 1, 1, 1]  # workers started and serving
    sockets = listening_sockets()
    names = {name for _, name, _, _ in sockets}
    assert any("gcs_server" in n for n in names), names
    assert any("raylet" in n for n in names), names
    assert len(sockets) >= 6, sockets
    assert [s for s in sockets if s[2] != "127.0.0.1"] == []
    assert 8265 not in {port for *_, port in sockets}  # no dashboard


def test_two_nodes_both_on_loopback_head_first(ray_cluster):
    nodes = ray_cluster.nodes()
    assert [n["address"] for n in nodes] == ["127.0.0.1", "127.0.0.1"]
    assert [n["is_head"] for n in nodes] == [True, False]
    assert [n["resources"]["CPU"] for n in nodes] == [3.0, 3.0]  # CPUS_PER_NODE in conftest.py
    assert ray_cluster.node_ids == [n["node_id"] for n in nodes]


def test_a_remote_call_past_its_limit_raises_naming_the_setting(ray_cluster):
    from tokenmill.controller.ray.cluster import ClusterError

    @ray.remote(num_cpus=0)
    def slow():
        import time

        time.sleep(30)

    ref = slow.remote()
    with pytest.raises(ClusterError, match=r"sleepy step: no answer within 0.5 s \(cluster.call_timeout_s\)"):
        ray_cluster.get(ref, timeout_s=0.5, what="sleepy step")
    ray.cancel(ref, force=True)


def test_joining_twice_is_refused(ray_cluster):
    from tokenmill.controller.ray.cluster import ClusterError, connect

    with pytest.raises(ClusterError, match="already initialised"):
        connect(None)
