"""Engine servers as Ray actors behind the usual RemoteEngine; a killed replica is routed around and replaced,
and the replacement loads the weights last pushed before the pool routes to it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")


def _greedy(url: str) -> tuple[list[int], int]:
    answer = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "n": 1,
                                                       "temperature": 0.0, "return_token_ids": True},
                        timeout=30).json()
    return answer["choices"][0]["token_ids"], answer["policy_version"]


def _record(errors: list, call) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the thread's failure, for the test to assert on
        errors.append(exc)


def test_a_killed_replica_is_routed_around_then_replaced(ray_cluster, tiny_model_path, listening_sockets,
                                                         tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.controller.ray.engines import EngineFleet
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.sync import FileSync
    from tokenmill.types import SamplingParams

    fleet = EngineFleet(ray_cluster, tiny_model_path, 2, cpus=1, threads=1, start_timeout_s=120)
    sync = FileSync(fleet.urls, tmp_path / "weights", timeout_s=30, drop_failed=True)
    engine = RemoteEngine(fleet.urls, pad_id=0, timeout_s=30, cooldown_s=120, retries=1, backoff_s=0.1, sync=sync)
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

        # new weights (version 3) on both replicas: their greedy answers change
        before_push = _greedy(first[1])
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        torch.manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        engine.update_weights(model.named_parameters(), version=3)
        pushed = _greedy(first[1])
        assert pushed[1] == 3 and pushed[0] != before_push[0]

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
        # the replacement serves the pushed weights (version 3), not the model folder's
        assert _greedy(new[0]) == pushed
        assert sync.servers.urls == [first[1], new[0]]  # the next push reaches it
        assert fleet.check() == []  # both live now: nothing replaced
        before = engine.pool.stats()[new[0]]["served"]
        for _ in range(3):
            engine.generate([[5, 6, 7]] * 4, params)
        assert engine.pool.stats()[new[0]]["served"] > before  # the pool routes to the new replica

        # a replacement under way as the run closes (its engine, then the fleet): stopped, not wired into the
        # closed engine (its HTTP clients are closed: loading the weights would raise)
        os.kill(fleet.replicas[0].server_pid, signal.SIGKILL)
        errors: list[BaseException] = []
        replacing = threading.Thread(target=lambda: _record(errors, fleet.check))
        replacing.start()
        time.sleep(1.0)  # the dead replica is seen at once; a new one takes seconds to start
        fleet.stop()
        engine.close()
        replacing.join(timeout=150)
        assert not replacing.is_alive() and errors == []
        assert fleet.urls == [new[0], first[1]] and fleet.restarts == 1  # nothing swapped in
    finally:
        engine.close()
        fleet.close()
