"""The Composer's third pass, server side: static files cached by content hash and JSON gzipped; a comparison's
effective config values, reward code compared by content, constant metrics, other x-axes and the same
prompt's completions across runs; a run archived; an exported YAML that validates from its own folder."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STARTED = 1_700_000_000.0
REWARD = "def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n"


def _run(folder: Path, config: dict, rows: list[dict], samples: list[dict] = (), reward: str | None = None) -> None:
    folder.mkdir(parents=True)
    if reward is not None:  # as a launched run keeps a page reward: its own copy, referenced by absolute path
        (folder / "rewards").mkdir()
        (folder / "rewards" / "short.py").write_text(reward)
        config = {**config, "rewards": [{"name": "short", "function": f"{folder}/rewards/short.py:short"}]}
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    (folder / "composer.json").write_text(json.dumps({"mode": "rl", "started": STARTED, "pid": None}))
    (folder / "status.json").write_text(json.dumps({"status": "finished", "returncode": 0, "ended": STARTED + 9}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))


def _rows(scale: float) -> list[dict]:
    return [{"step": s, "reward/mean": scale * s, "lr": 1e-5, "timing_s/step": 2.0,
             "throughput/e2e_tok_s": 50.0 * s} for s in (1, 2, 3)]


def _sample(step: int, prompt: str, completion: str, reward: float) -> dict:
    return {"step": step, "prompt": prompt, "completion": completion, "reward": reward, "advantage": 0.5,
            "stop": "stop", "rewards": {"short": reward}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    base = {"model": {"path": "m"}, "data": {"task": "addition"}}
    _run(runs / "a", base, _rows(1.0), [_sample(1, "1+1=", "2", 1.0), _sample(2, "2+2=", "4", 1.0)], REWARD)
    _run(runs / "b", {**base, "generation": {"group_size": 4}}, _rows(2.0),
         [_sample(1, "2+2=", "5", 0.0), _sample(3, "2+2=", "4", 1.0)], REWARD)  # byte-identical code
    _run(runs / "c", base, _rows(1.0), [], REWARD.replace("-len(c)", "len(c)"))
    with TestClient(create_app(TOKEN, runs), base_url="http://127.0.0.1", headers=AUTH) as c:
        yield c


def test_static_files_are_cached_by_content_hash_and_revalidated_by_etag(client):
    page = client.get("/")
    assert page.headers["cache-control"] == "no-cache" and page.headers["etag"]
    script = re.search(r'src="(/static/app\.js\?v=([0-9a-f]{16}))"', page.text)
    assert script and 'href="/static/app.css?v=' in page.text, page.text
    assert client.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
    hashed = client.get(script.group(1), headers={"Accept-Encoding": "gzip"})
    assert hashed.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert hashed.headers["content-encoding"] == "gzip" and hashed.headers["etag"] == f'"{script.group(2)}-gz"'
    again = client.get(script.group(1), headers={"Accept-Encoding": "gzip", "If-None-Match": hashed.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    stale = client.get("/static/app.js?v=0000000000000000")  # an old page's address: revalidated, not kept
    assert stale.headers["cache-control"] == "no-cache"


def test_json_answers_travel_gzipped_and_the_event_stream_does_not(client):
    raw = client.get("/api/schema", headers={"Accept-Encoding": "gzip"}, extensions={})
    assert raw.headers["content-encoding"] == "gzip"
    with client.stream("GET", "/api/schema", headers={"Accept-Encoding": "gzip"}) as answer:
        wire = b"".join(answer.iter_raw())
    assert len(wire) * 4 < len(gzip.decompress(wire)), len(wire)  # the schema shrinks 4x or more on the wire
    events = client.get("/api/runs/a/events", params={"follow": 0}, headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in events.headers and "event: metrics" in events.text


def test_the_config_diff_shows_effective_values_and_compares_reward_code_by_content(client):
    out = client.get("/api/compare", params={"ids": "a,b"}).json()
    # a's YAML leaves group_size out: its default (8) is what it ran with, not "absent"
    assert out["config_diff"] == [{"path": "generation.group_size", "values": {"a": 8, "b": 4}}]
    assert out["reward_code"] == []  # the same code in two run folders: no difference
    other = client.get("/api/compare", params={"ids": "a,c"}).json()
    paths = [d["path"] for d in other["config_diff"]]
    assert paths == ["rewards.short.code"], paths
    (code,) = other["reward_code"]
    assert code["name"] == "short" and code["code"] == {"a": REWARD, "c": REWARD.replace("-len(c)", "len(c)")}
    assert "-    return [-len(c) for c in completions]\n+    return [len(c) for c in completions]" in code["diff"]["c"]


def test_constant_metrics_are_named_and_other_x_axes_are_given(client):
    out = client.get("/api/compare", params={"ids": "a,b"}).json()
    assert out["constant"] == ["lr", "timing_s/step"]
    a = out["runs"][0]
    assert a["axes"]["wall_s"] == [[1, 2.0], [2, 4.0], [3, 6.0]]
    assert a["axes"]["tokens"] == [[1, 100.0], [2, 300.0], [3, 600.0]]  # 50*1*2, + 50*2*2, + 50*3*2


def test_the_same_prompts_completions_from_each_run(client):
    out = client.get("/api/compare/samples", params={"ids": "a,b"}).json()
    assert out["prompts"] == ["2+2="] and out["prompt"] == "2+2="
    assert [s["completion"] for s in out["completions"]["a"]] == ["4"]
    assert [(s["step"], s["completion"], s["reward"]) for s in out["completions"]["b"]] == [(1, "5", 0.0), (3, "4", 1.0)]
    none = client.get("/api/compare/samples", params={"ids": "a,c"}).json()
    assert none["prompts"] == [] and none["completions"] == {"a": [], "c": []}


def test_a_run_is_archived_and_keeps_its_labels(client):
    client.post("/api/runs/b/labels", json={"name": "wide", "tags": ["g4"]})
    done = client.post("/api/runs/b/labels", json={"name": "wide", "tags": ["g4"], "archived": True}).json()
    assert done["archived"] is True and done["tags"] == ["g4"]
    kept = client.post("/api/runs/b/labels", json={"name": "wide!", "tags": ["g4"]}).json()  # archived unchanged
    assert kept["archived"] is True and kept["name"] == "wide!"
    listed = {r["id"]: r["archived"] for r in client.get("/api/runs").json()["runs"]}
    assert listed == {"a": False, "b": True, "c": False}


def test_an_exported_yaml_validates_from_the_folder_it_is_saved_in(client, tiny_model_path, tmp_path, monkeypatch):
    """The Composer was started beside the model folder (model.path relative to there); the YAML and the page's
    reward saved into another folder validate when `tokenmill validate` runs from that folder."""
    model = Path(tiny_model_path)
    monkeypatch.chdir(model.parent)
    config = {"model": {"path": f"./{model.name}"}, "data": {"task": "addition"}}  # "./": a local path
    rewards = [{"name": "short", "code": REWARD, "function": "short"}]
    out = client.post("/api/yaml/export", json={"mode": "rl", "config": config, "rewards": rewards}).json()
    exported = yaml.safe_load(out["yaml"])
    assert exported["model"]["path"] == str(model.resolve())
    assert exported["rewards"][0]["function"] == "rewards/short.py:short"  # beside the YAML, relative
    folder = tmp_path / "exported"
    (folder / "rewards").mkdir(parents=True)
    (folder / out["filename"]).write_text(out["yaml"])
    for f in out["files"]:
        (folder / f["path"]).write_text(f["content"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "validate", out["filename"]], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_run_clones_into_compose_with_its_page_rewards_as_code(client):
    """The run's config without its own output folder, and a reward written in the page (a file of the run's
    rewards/ folder) back as code the page can edit."""
    out = client.get("/api/runs/c/clone").json()
    assert out["mode"] == "rl" and out["config"]["model"] == {"path": "m"}
    assert "output_dir" not in out["config"].get("tracking", {}) and out["config"]["rewards"] == []
    assert out["rewards"] == [{"name": "short", "function": "short", "code": REWARD.replace("-len(c)", "len(c)"),
                               "weight": 1.0, "timeout_s": 10.0}]
    assert client.get("/api/runs/nope/clone").status_code == 404


def test_runs_list_config_columns(client):
    runs = {r["id"]: r["columns"] for r in client.get(
        "/api/runs", params={"columns": "generation.group_size,model.path"}).json()["runs"]}
    assert runs["b"] == {"generation.group_size": 4, "model.path": "m"}
    assert runs["a"] == {"generation.group_size": 8, "model.path": "m"}  # left to its default: the default
    assert "columns" not in client.get("/api/runs").json()["runs"][0]


def test_a_run_without_a_checkpoint_is_not_resumed(client):
    answer = client.post("/api/runs/a/resume")
    assert answer.status_code == 409 and "no complete checkpoint to resume from" in answer.json()["error"]
    assert client.get("/api/runs/a").json()["status"] == "finished"  # untouched
