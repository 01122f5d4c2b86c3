"""The Composer's limits: a cap on concurrent runs (real `tokenmill train` subprocesses), a timeout on a reward
model in the reward preview, and preview workers that die with the Composer."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from fastapi.testclient import TestClient

from tokenmill.cli import main
from tokenmill.composer.app import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(runs_dir: Path, **kwargs) -> TestClient:
    return TestClient(create_app(TOKEN, runs_dir, **kwargs), base_url="http://127.0.0.1", headers=AUTH)


def _long_run(model: str) -> dict:
    return {"mode": "rl", "config": {"model": {"path": model}, "data": {"task": "addition", "num_eval": 0},
                                     "controller": {"steps": 100000}}}


def test_a_launch_beyond_max_runs_is_a_clear_409(tmp_path, tiny_model_path):
    body = _long_run(tiny_model_path)
    with _client(tmp_path, max_runs=1) as client:
        assert client.get("/api/runs").json() == {"runs": [], "max_runs": 1}
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # racing launches: the cap still holds
            answers = list(pool.map(lambda _: client.post("/api/runs", json=body), range(3)))
        assert sorted(r.status_code for r in answers) == [201, 409, 409]
        first = next(r.json()["id"] for r in answers if r.status_code == 201)
        refused = next(r.json() for r in answers if r.status_code == 409)
        assert refused == {
            "error": f"runs: 1 run(s) already running, the most this Composer starts at once (--max-runs 1); "
                     f"stop one or wait for it to end: {first}",
            "running": [first], "max_runs": 1}
        # a restarted Composer on the same folder counts the run it did not launch
        with _client(tmp_path, max_runs=1) as again:
            assert again.post("/api/runs", json=body).json()["running"] == [first]
        assert client.post(f"/api/runs/{first}/stop").json()["status"] == "stopped"
        second = client.post("/api/runs", json=body)
        assert second.status_code == 201, second.text
        assert client.post(f"/api/runs/{second.json()['id']}/stop").json()["status"] == "stopped"
        assert [r["status"] for r in client.get("/api/runs").json()["runs"]] == ["stopped", "stopped"]


def test_max_runs_two_allows_two(tmp_path, tiny_model_path):
    body = _long_run(tiny_model_path)
    with _client(tmp_path, max_runs=2) as client:
        ids = [client.post("/api/runs", json=body).json()["id"] for _ in range(2)]
        third = client.post("/api/runs", json=body)
        assert third.status_code == 409 and sorted(third.json()["running"]) == sorted(ids)
        for run_id in ids:
            assert client.post(f"/api/runs/{run_id}/stop").json()["status"] == "stopped"


def test_cli_refuses_max_runs_below_one(capsys):
    assert main(["composer", "--max-runs", "0", "--port", "0"]) == 2
    assert "--max-runs must be at least 1 (got 0)" in capsys.readouterr().err
