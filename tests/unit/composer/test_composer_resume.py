"""Resuming a Composer run from its checkpoint: a run that stopped after one of its two steps (with a checkpoint,
`controller.max_steps_per_run`) is launched again in its own folder and ends with both steps (real `tokenmill
train` subprocesses on a tiny model)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app

TOKEN = "t0ken"


def _wait_ended(client: TestClient, run_id: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.get(f"/api/runs/{run_id}").json()
        if info["status"] not in ("running", "queued"):
            return info
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} still running after {timeout_s} s")


@pytest.mark.slow  # two launches of a real trainer: about 50 s on a loaded machine
def test_a_run_resumes_from_its_checkpoint_in_its_own_folder(tmp_path: Path, tiny_model_path):
    config = {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
              "controller": {"steps": 2, "max_steps_per_run": 1, "prompts_per_step": 2},
              "generation": {"group_size": 2, "max_tokens": 4}}
    with TestClient(create_app(TOKEN, tmp_path), base_url="http://127.0.0.1",
                    headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        run_id = client.post("/api/runs", json={"mode": "rl", "config": config}).json()["id"]
        first = _wait_ended(client, run_id)
        assert first["step"] == 1, (first, (tmp_path / run_id / "log.txt").read_text()[-2000:])
        again = client.post(f"/api/runs/{run_id}/resume")
        assert again.status_code == 200 and again.json()["status"] == "running", again.text
        assert client.post(f"/api/runs/{run_id}/resume").status_code == 409  # it runs now
        done = _wait_ended(client, run_id)
        log = (tmp_path / run_id / "log.txt").read_text()
        assert done["status"] == "finished" and done["step"] == 2, (done, log[-2000:])
        steps = [json.loads(line)["step"] for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2], steps  # one file, grown by the resumed run
