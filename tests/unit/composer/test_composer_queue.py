"""The Composer's launch queue and sweeps: at --max-runs a launch may wait instead of being refused (409), a
sweep queues one run per value of a field, and a queued run starts when a running one ends (real `tokenmill
train` subprocesses on a tiny model)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app

TOKEN = "t0ken"


def _body(model: str, **extra) -> dict:
    return {"mode": "rl", "config": {"model": {"path": model}, "data": {"task": "addition", "num_eval": 0},
                                     "controller": {"steps": 100000}}, **extra}


def _status(client: TestClient, run_id: str) -> str:
    return client.get(f"/api/runs/{run_id}").json()["status"]


def test_queued_runs_and_a_sweep_start_as_slots_free(tmp_path: Path, tiny_model_path):
    with TestClient(create_app(TOKEN, tmp_path, max_runs=1), base_url="http://127.0.0.1",
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        first = client.post("/api/runs", json=_body(tiny_model_path)).json()["id"]
        assert client.post("/api/runs", json=_body(tiny_model_path)).status_code == 409  # no queue asked: as before
        waiting = client.post("/api/runs", json=_body(tiny_model_path, queue=True))
        assert waiting.status_code == 202 and waiting.json()["status"] == "queued" and waiting.json()["position"] == 1
        second = waiting.json()["id"]
        bad = client.post("/api/sweep", json={**_body(tiny_model_path), "field": "algorithm.kl_coef",
                                              "values": [0.01, "lots"]})
        assert bad.status_code == 422 and bad.json()["error"].startswith("algorithm.kl_coef = 'lots': ")
        sweep = client.post("/api/sweep", json={**_body(tiny_model_path), "field": "algorithm.kl_coef",
                                                "values": [0.01, 0.05]}).json()
        swept = [r["id"] for r in sweep["runs"]]
        assert [r["status"] for r in sweep["runs"]] == ["queued", "queued"] and len(swept) == 2
        assert [yaml.safe_load((tmp_path / i / "run.yaml").read_text())["algorithm"]["kl_coef"] for i in swept] == [
            0.01, 0.05]
        listed = {r["id"]: r for r in client.get("/api/runs").json()["runs"]}
        assert [listed[i]["status"] for i in (first, second, *swept)] == ["running", "queued", "queued", "queued"]
        assert listed[swept[0]]["tags"] == [sweep["tag"]] and listed[swept[0]]["name"] == "kl_coef=0.01"
        for run_id in swept:  # a queued run leaves the queue without ever starting
            assert client.post(f"/api/runs/{run_id}/stop").json()["status"] == "stopped"
        assert client.post(f"/api/runs/{first}/stop").json()["status"] == "stopped"
        deadline = time.monotonic() + 30
        while _status(client, second) != "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _status(client, second) == "running"  # the slot the first run left
        assert client.post(f"/api/runs/{second}/stop").json()["status"] == "stopped"
        assert [_status(client, i) for i in swept] == ["stopped", "stopped"]
        assert not any((tmp_path / i / "log.txt").exists() for i in swept)
