"""Composer runs read from their folders: nested run folders, names and tags, duration, 2-4 runs compared
(curves per metric, config keys that differ), alarms and efficiency reports from events.jsonl, report.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app

TOKEN = "t0ken"
STARTED = 1_700_000_000.0


def write_run(folder: Path, config: dict, rows: list[dict], *, seconds: float = 90.0, events: list[dict] = ()) -> None:
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    (folder / "composer.json").write_text(json.dumps({"mode": "rl", "started": STARTED, "pid": None}))
    (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0,
                                                    "ended": STARTED + seconds}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def rl_rows(scale: float) -> list[dict]:
    rows = [{"step": s, "reward/mean": scale * s, "kl": 0.01 * s, "entropy": 1.0 - 0.1 * s,
             "timing_s/step": 1.0} for s in (1, 2, 3)]
    return [*rows, {"step": 3, "eval/accuracy": 0.5 * scale}]


ALARM = {"event": "alarm", "name": "reward_flat", "metric": "reward/std", "value": 0.0, "threshold": 1e-6,
         "policy": "warn", "message": "every group scored alike for 5 steps", "step": 2}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    base = {"model": {"path": "m"}, "data": {"task": "addition"}, "controller": {"steps": 3},
            "tracking": {"output_dir": "x"}}
    write_run(runs / "sweep" / "lr-a", {**base, "algorithm": {"kl_coef": 0.01}}, rl_rows(1.0), events=[
        {"event": "stage", "stage": "generate", "step": 1, "t": STARTED}, ALARM,
        {"event": "efficiency_report", "tokens_per_s": 1234.5, "mfu": 0.31}])
    write_run(runs / "sweep" / "lr-b", {**base, "algorithm": {"kl_coef": 0.05}, "tracking": {"output_dir": "y"}},
              rl_rows(2.0), seconds=30.5)
    write_run(runs / "sft-1", {"model": {"path": "m"}}, [
        {"step": s, "loss": 2.0 / s, "accuracy": 0.2 * s, "lr": 1e-5, "grad_norm": 1.5} for s in (1, 2)])
    (runs / "sweep" / "lr-a" / "final").mkdir()  # a run's own subfolder is not a run
    with TestClient(create_app(TOKEN, runs), base_url="http://127.0.0.1",
                    headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_nested_run_folders_are_listed_with_their_duration(client):
    runs = {r["id"]: r for r in client.get("/api/runs").json()["runs"]}
    assert set(runs) == {"sweep/lr-a", "sweep/lr-b", "sft-1"}
    assert runs["sweep/lr-a"]["duration_s"] == 90.0 and runs["sweep/lr-b"]["duration_s"] == 30.5
    assert runs["sweep/lr-a"]["last_metrics"]["reward/mean"] == 3.0  # the last training row, not the eval
    assert client.get("/api/runs/sweep/lr-b").json()["config"]["algorithm"]["kl_coef"] == 0.05


def test_a_run_is_named_and_tagged(client):
    answer = client.post("/api/runs/sweep/lr-a/labels", json={"name": " low lr ", "tags": ["lr", "base", "lr"]})
    assert answer.status_code == 200, answer.text
    listed = {r["id"]: r for r in client.get("/api/runs").json()["runs"]}["sweep/lr-a"]
    assert (listed["name"], listed["tags"]) == ("low lr", ["lr", "base"])
    bad = client.post("/api/runs/sweep/lr-a/labels", json={"name": "x", "tags": ["has space"]})
    assert bad.status_code == 422 and bad.json()["error"].startswith("tags: 'has space' is not a tag")
    assert client.post("/api/runs/sweep/../x/labels", json={"tags": []}).status_code == 404


def test_two_runs_compare_curves_and_config_differences(client):
    out = client.get("/api/compare", params={"ids": "sweep/lr-a,sweep/lr-b"}).json()
    assert out["metrics"][:4] == ["reward/mean", "eval/accuracy", "kl", "entropy"]
    a, b = out["runs"]
    assert a["curves"]["reward/mean"] == [[1, 1.0], [2, 2.0], [3, 3.0]]
    assert b["curves"]["reward/mean"] == [[1, 2.0], [2, 4.0], [3, 6.0]]
    assert b["curves"]["eval/accuracy"] == [[3, 1.0]]
    # the output folders differ by construction and are not listed; the KL coefficient is
    assert out["config_diff"] == [{"path": "algorithm.kl_coef", "values": {"sweep/lr-a": 0.01, "sweep/lr-b": 0.05}}]
    one = client.get("/api/compare", params={"ids": "sweep/lr-a"})
    assert one.status_code == 400 and "compare 2 to 4 runs" in one.json()["error"]
    # an SFT run beside an RL one: only what both have is a shared metric; the RL-only keys differ
    mixed = client.get("/api/compare", params={"ids": "sweep/lr-a,sft-1"}).json()
    assert mixed["metrics"] == []
    assert {"path": "algorithm.kl_coef", "values": {"sweep/lr-a": 0.01, "sft-1": None}} in mixed["config_diff"]


def test_alarms_and_efficiency_reports_are_streamed_and_report_json_is_served(client, tmp_path):
    text = client.get("/api/runs/sweep/lr-a/events", params={"follow": 0}).text
    frames = [f for f in text.split("\n\n") if f.strip()]
    kinds = [line.split(": ", 1)[1] for f in frames for line in f.splitlines() if line.startswith("event: ")]
    assert kinds.count("stage") == 1 and kinds.count("alarm") == 1 and kinds.count("efficiency") == 1
    alarm = next(f for f in frames if "event: alarm" in f)
    assert json.loads(alarm.split("data: ", 1)[1]) == ALARM
    assert client.get("/api/runs/sweep/lr-a/report").json() == {"report": None}
    folder = Path(client.get("/api/runs/sweep/lr-a").json()["output_dir"])
    (folder / "report.json").write_text(json.dumps({"tokens_per_s": 1234.5, "stages": {"train": 0.6}}))
    assert client.get("/api/runs/sweep/lr-a/report").json() == {"report": {"tokens_per_s": 1234.5,
                                                                           "stages": {"train": 0.6}}}


def test_a_preset_points_at_a_local_model_folder_and_says_so(tmp_path, tiny_model_path):
    """With a models folder holding `<name>/config.json` for a preset's hub id, the preset's model.path is that
    folder and its model_source names it; the other presets still name the Hub."""
    from tokenmill.composer.presets import presets

    (tmp_path / "Qwen2.5-0.5B-Instruct").symlink_to(Path(tiny_model_path), target_is_directory=True)
    laptop, gpu = presets("rl", models_dir=tmp_path)[:2]
    local = (tmp_path / "Qwen2.5-0.5B-Instruct").resolve()
    assert laptop["config"]["model"]["path"] == str(local) and laptop["local"] is True
    assert laptop["model_source"] == f"local folder {local}"
    assert gpu["config"]["model"]["path"] == "Qwen/Qwen2.5-1.5B-Instruct" and gpu["local"] is False
    assert "TOKENMILL_MODELS_DIR" in gpu["model_source"]
