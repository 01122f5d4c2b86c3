"""Engine servers as Ray actors behind the usual RemoteEngine; a killed replica is routed around and replaced."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

ray = pytest.importorskip("ray")


def test_a_killed_replica_is_routed_around_then_replaced(ray_cluster, tiny_model_path, listening_sockets):
    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.engines.openai import RemoteEngine
    from tokenmill.types import SamplingParams

    fleet = EngineFleet(ray_cluster, tiny_model_path, 2, cpus=1, threads=1, start_timeout_s=120)
    engine = RemoteEngine(fleet.urls, pad_id=0, timeout_s=30, cooldown_s=120, retries=1, backoff_s=0.1)
    fleet.attach(engine)
    replaced: list[str] = []
    fleet.on_replace = replaced.append
    params = SamplingParams(max_tokens=3, n=2, temperature=1.0)
    try:
        first = [r.url for r in fleet.replicas]
        assert len(set(first)) == 2 and all(u.startswith("http://127.0.0.1:") for u in first)
        assert [len(g) for g in engine.generate([[5, 6, 7]] * 4, params)] == [2, 2, 2, 2]
        sockets = listening_sockets()
        assert {r.server_pid for r in fleet.replicas} <= {pid for pid, *_ in sockets}
        assert [s for s in sockets if s[2] != "127.0.0.1"] == []

        os.kill(fleet.replicas[0].server_pid, signal.SIGKILL)
        # the run keeps stepping on the live replica while the dead one is still listed
        for _ in range(2):
            assert [len(g) for g in engine.generate([[5, 6, 7]] * 4, params)] == [2, 2, 2, 2]
        assert engine.pool.stats()[first[0]]["up"] is False

        new = fleet.check()
        assert len(new) == 1 and new[0] not in first and replaced == new
        assert fleet.restarts == 1
        assert fleet.urls == [new[0], first[1]]
        assert [e.url for e in engine.pool.endpoints] == fleet.urls
        answer = httpx.post(new[0] + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 1},
                            timeout=30).json()
        assert len(answer["choices"]) == 1
        assert fleet.check() == []  # both live now: nothing replaced
        before = engine.pool.stats()[new[0]]["served"]
        for _ in range(3):
            engine.generate([[5, 6, 7]] * 4, params)
        assert engine.pool.stats()[new[0]]["served"] > before  # the pool routes to the new replica
    finally:
        engine.close()
        fleet.close()
