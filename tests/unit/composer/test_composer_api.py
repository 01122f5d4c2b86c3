"""Composer API: schema levels, presets, validation, YAML export/import (accepted by `tokenmill validate`),
the four-model diagram, the reward preview against a hand computation, the SSE tail's resume by byte offset,
and a tiny run launched from the API whose metrics stream back (real uvicorn for the streams)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from tokenmill.composer.app import create_app
from tokenmill.composer.schema_ui import LEVELS
from tokenmill.config.modes import MODES
from tokenmill.serving import start_in_thread

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RL = {"model": {"path": "some/model"}, "data": {"task": "addition"}, "controller": {"steps": 7},
      "algorithm": {"kl_coef": 0.05}, "generation": {"group_size": 4, "stop": ["\n"]}}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("composer-runs")


@pytest.fixture(scope="module")
def client(runs_dir):
    with TestClient(create_app(TOKEN, runs_dir), base_url="http://127.0.0.1", headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def server(runs_dir):
    srv, _ = start_in_thread(create_app(TOKEN, runs_dir))
    yield srv
    srv.stop()


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=cwd, check=False)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("mode", list(MODES))
def test_schema_levels_nest_and_simple_is_small(client, mode):
    out = client.get(f"/api/schema?mode={mode}").json()
    fields = out["fields"]
    rank = {lvl: i for i, lvl in enumerate(LEVELS)}
    shown = {lvl: {f["path"] for f in fields if rank[f["level"]] <= rank[lvl]} for lvl in LEVELS}
    assert shown["simple"] < shown["advanced"] < shown["expert"]  # strict subsets
    assert shown["expert"] == {f["path"] for f in fields}
    assert 6 <= len(shown["simple"]) <= 14, sorted(shown["simple"])
    assert {"model.path", "data.task"} <= shown["simple"]
    assert all(f["description"] for f in fields if f["path"] != "rewards" or mode == "rl")
    assert {m["id"] for m in out["modes"]} == {"rl", "preference", "reward_model", "sft"}
    if mode == "reward_model":
        assert "objective" not in shown["expert"]  # fixed by the mode
    by_path = {f["path"]: f for f in fields}
    if mode == "rl":
        steps = by_path["controller.steps"]
        assert (steps["type"], steps["default"], steps["minimum"], steps["level"]) == ("integer", 100, 1, "simple")
        # the schema's own choices, in its order (the page renders exactly these)
        from typing import get_args

        from tokenmill.config.schema import AlgorithmConfig
        choices = list(get_args(AlgorithmConfig.model_fields["advantage"].annotation))
        assert by_path["algorithm.advantage"]["enum"] == choices and choices[:4] == ["grpo", "rloo", "reinforce_pp", "gae"]
        assert by_path["env.name"]["optional_section"] == "env"
        assert by_path["generation.stop"]["type"] == "list" and by_path["generation.stop"]["items"] == "string"


def test_unknown_mode_is_a_clear_400(client):
    r = client.get("/api/schema?mode=nope")
    assert r.status_code == 400 and "mode" in r.json()["error"]


@pytest.mark.parametrize("mode", list(MODES))
def test_presets_are_valid_configs(client, mode):
    presets = client.get(f"/api/presets?mode={mode}").json()
    assert [p["id"] for p in presets] == ["laptop_cpu", "gpu_24gb", "gpu_80gb", "node_8xh100"]
    assert [p["num_devices"] for p in presets] == [1, 1, 1, 1]  # one trainer process, on one device
    for p in presets:
        r = client.post("/api/validate", json={"mode": mode, "config": p["config"]}).json()
        assert r["ok"], (p["id"], r["errors"])


@pytest.mark.parametrize("mode", list(MODES))
def test_every_preset_fits_its_own_device(client, mode):
    for p in client.get(f"/api/presets?mode={mode}").json():
        est = client.post("/api/estimate", json={"mode": mode, "config": p["config"],
                                                 "device_memory_gib": p["device_memory_gib"],
                                                 "num_devices": p["num_devices"]}).json()
        device = est["devices"][0]
        assert device["fits"] and device["total_bytes"] <= device["budget_bytes"], (p["id"], device)
        assert est["warnings"] == [] and est["budget"]["fits"], (p["id"], est["warnings"])
        roles = [m["role"] for m in est["models"]]
        if mode == "rl" and p["id"] == "node_8xh100":  # generation runs in engine servers on other GPUs
            assert p["config"]["engine"]["placement"] == "process" and "engine" not in roles
        elif mode == "rl":
            assert roles[-1] == "engine"


def test_validate_names_the_field(client):
    bad = {**RL, "algorithm": {"clip_low": 3}, "generation": {"group_size": 0}}
    r = client.post("/api/validate", json={"mode": "rl", "config": bad}).json()
    assert r["ok"] is False and r["config"] is None
    assert {e["path"] for e in r["errors"]} == {"algorithm.clip_low", "generation.group_size"}
    ok = client.post("/api/validate", json={"mode": "rl", "config": RL}).json()
    assert ok["ok"] and ok["config"]["controller"]["steps"] == 7 and ok["config"]["training"]["learning_rate"] == 1e-5


def test_yaml_export_round_trips_and_the_cli_accepts_it(client, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n")
    config = {**RL, "rewards": [{"name": "short", "function": f"{reward}:short", "weight": 0.5}]}
    out = client.post("/api/yaml/export", json={"mode": "rl", "config": config}).json()
    assert out["command"] == "tokenmill train rl.yaml"
    assert yaml.safe_load(out["yaml"])["controller"] == {"steps": 7}  # only what differs from the defaults
    normalized = client.post("/api/validate", json={"mode": "rl", "config": config}).json()["config"]
    back = client.post("/api/yaml/import", json={"yaml": out["yaml"]}).json()
    assert back["errors"] == [] and back["mode"] == "rl" and back["config"] == normalized
    path = tmp_path / out["filename"]
    path.write_text(out["yaml"])
    done = _cli("validate", str(path), cwd=tmp_path)  # imports the reward file: a 'file.py:function' string
    assert done.returncode == 0, done.stderr
    assert "7 steps of 8 prompts x 4 samples" in done.stdout


def test_export_carries_the_pages_code_rewards_as_files(client, tmp_path):
    code = "def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n"
    page = [{"name": "short", "code": code, "function": "short", "weight": 0.5}]
    out = client.post("/api/yaml/export", json={"mode": "rl", "config": RL, "rewards": page}).json()
    assert out["files"] == [{"path": "rewards/short.py", "content": code}]
    tree = yaml.safe_load(out["yaml"])
    assert tree["mode"] == "rl" and tree["rewards"] == [{"name": "short", "function": "rewards/short.py:short",
                                                         "weight": 0.5}]
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "short.py").write_text(code)
    (tmp_path / "rl.yaml").write_text(out["yaml"])
    done = _cli("validate", "rl.yaml", cwd=tmp_path)  # run from the folder the files were saved in
    assert done.returncode == 0, done.stderr
    # imported back into the page that holds the code, the entry is not doubled
    back = client.post("/api/yaml/import", json={"yaml": out["yaml"], "rewards": [{"name": "short",
                                                                                  "function": "short"}]}).json()
    assert back["errors"] == [] and back["config"]["rewards"] == []
    elsewhere = client.post("/api/yaml/import", json={"yaml": out["yaml"]}).json()
    assert [r["function"] for r in elsewhere["config"]["rewards"]] == ["rewards/short.py:short"]
    bad = client.post("/api/yaml/export", json={"mode": "sft", "config": {}, "rewards": page})
    assert bad.status_code == 422 and bad.json()["error"] == "rewards: only mode rl takes reward functions, not sft"


@pytest.mark.parametrize("mode,config,key,value", [
    ("sft", {"model": {"path": "m"}, "data": {"task": "addition"}, "steps": 3, "packing": True}, "steps", 3),
    ("preference", {"model": {"path": "m"}, "data": {"task": "addition"}, "objective": "ipo"}, "objective", "ipo"),
    ("reward_model", {"model": {"path": "m"}, "data": {"task": "addition"}, "steps": 9}, "objective", "reward_model"),
])
def test_yaml_round_trip_other_modes(client, mode, config, key, value):
    out = client.post("/api/yaml/export", json={"mode": mode, "config": config}).json()
    back = client.post("/api/yaml/import", json={"yaml": out["yaml"]}).json()
    assert back["mode"] == mode and back["errors"] == [] and back["config"][key] == value


def test_yaml_import_errors_are_data(client):
    assert client.post("/api/yaml/import", json={"yaml": "a: [1"}).json()["errors"][0]["path"] == "yaml"
    r = client.post("/api/yaml/import", json={"yaml": "model: {path: m, devcie: cpu}\ndata: {task: addition}\n"
                                                      "foo: 1\n"}).json()
    # keys the schema lacks are left out (the form could neither show nor remove them), and named
    assert r["errors"] == [{"path": "model.devcie",
                            "message": "unknown key, left out of the imported config; did you mean device?"},
                           {"path": "foo", "message": "unknown key, left out of the imported config"}]
    assert r["config"]["model"]["path"] == "m" and "foo" not in r["config"] and "devcie" not in r["config"]["model"]
    r = client.post("/api/yaml/import", json={"yaml": "model: {path: m}\ndata: {task: addition}\nfoo: 1\n"
                                                      "generation: {group_size: 0}\n"}).json()
    assert [e["path"] for e in r["errors"]] == ["foo", "generation.group_size"]  # other errors still come back
    r = client.post("/api/yaml/export", json={"mode": "rl", "config": {"model": {}}})
    assert r.status_code == 422 and r.json()["errors"][0]["path"] in ("model.path", "data")


def test_diagram_follows_the_algorithm(client):
    def roles(config, mode="rl"):
        out = client.post("/api/diagram", json={"mode": mode, "config": config}).json()
        assert [m["role"] for m in out["models"]] == ["actor", "critic", "reward", "reference"]
        return {m["role"]: m for m in out["models"]}, out["flows"]

    grpo, flows = roles({**RL, "algorithm": {"kl_coef": 0.0}, "model": {"path": "m", "device": "cpu"}})
    assert grpo["actor"]["active"] and grpo["actor"]["device"] == "cpu"
    assert not grpo["critic"]["active"] and not grpo["reference"]["active"] and grpo["reward"]["active"]
    assert "kl_coef is 0" in grpo["reference"]["why"]
    assert {(f["from"], f["to"]) for f in flows} == {("actor", "reward"), ("reward", "actor")}
    ppo, _ = roles({**RL, "algorithm": {"advantage": "gae", "kl_coef": 0.1}})
    assert ppo["critic"]["active"] and ppo["critic"]["trainable"] and ppo["reference"]["active"]
    dpo, _ = roles({"model": {"path": "m"}, "data": {"task": "addition"}, "objective": "dpo"}, "preference")
    simpo, _ = roles({"model": {"path": "m"}, "data": {"task": "addition"}, "objective": "simpo"}, "preference")
    assert dpo["reference"]["active"] and not simpo["reference"]["active"]
    rm, _ = roles({"model": {"path": "m"}, "data": {"task": "addition"}}, "reward_model")
    assert rm["reward"]["trainable"] and not rm["actor"]["active"]
    partial, _ = roles({"algorithm": {"advantage": "gae"}})  # no model or data yet: still drawn
    assert partial["critic"]["active"]


def test_estimate_route_returns_the_estimator_output(client):
    from tokenmill.estimate import estimate_for_config

    config = {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "data": {"task": "addition"}}
    r = client.post("/api/estimate", json={"mode": "rl", "config": config, "device_memory_gib": 24})
    assert r.status_code == 200, r.text
    normalized = client.post("/api/validate", json={"mode": "rl", "config": config}).json()["config"]
    assert r.json() == json.loads(json.dumps(estimate_for_config({**normalized, "mode": "rl"},
                                                                 device_memory_gib=24, num_devices=1)))


# ------------------------------------------------------------------------------------------ rewards
def test_preview_scores_equal_the_function_applied_by_hand(client, tiny_model_path):
    code = ("def shape(prompts, completions, answer, **kw):\n"
            "    return [len(c) / 10 + (c.count('1') if a else 0) for c, a in zip(completions, answer)]\n")
    per_sample = "def digits(prompt, completion):\n    return sum(ch.isdigit() for ch in completion)\n"
    body = {"mode": "rl", "config": {"model": {"path": tiny_model_path}, "data": {"task": "addition"},
                                     "generation": {"max_tokens": 6}},
            "rewards": [{"name": "shape", "code": code, "function": "shape", "weight": 0.5},
                        {"name": "digits", "code": per_sample, "function": "digits", "weight": 2.0,
                         "per_sample": True},
                        {"name": "broken", "code": "def broken(:\n", "function": "broken"},
                        {"name": "raises", "code": "def raises(completions, **k):\n    raise ValueError('nope')\n",
                         "function": "raises"}],
            "prompts": 3, "samples": 2}
    out = client.post("/api/rewards/preview", json=body)
    assert out.status_code == 200, out.text
    out = out.json()
    assert len(out["samples"]) == 6 and len(out["groups"]) == 3
    for s in out["samples"]:
        c = s["completion"]
        shape = len(c) / 10 + c.count("1")
        digits = sum(ch.isdigit() for ch in c)
        answer = str(eval(s["prompt"].rstrip("=")))  # addition prompts look like "12+34="
        addition = 1.0 if c.strip() == answer else 0.0
        assert s["scores"]["shape"] == pytest.approx(shape)
        assert s["scores"]["digits"] == digits
        assert s["scores"]["addition"] == addition
        assert s["total"] == pytest.approx(0.5 * shape + 2.0 * digits + addition)
        assert s["scores"]["broken"] is None and s["errors"]["broken"].startswith("SyntaxError")
        assert s["scores"]["raises"] is None and "ValueError: nope" in s["errors"]["raises"]
    zero = sum(len({s["total"] for s in out["samples"] if s["group"] == g}) == 1 for g in range(3)) / 3
    assert out["zero_variance_fraction"] == pytest.approx(zero)


def test_file_import_strings(tmp_path):
    from tokenmill.config.imports import resolve as import_string
    from tokenmill.types import ConfigError

    (tmp_path / "r.py").write_text("K = 3\ndef f(prompts, completions, **kw):\n    return [K] * len(completions)\n")
    fn = import_string(f"{tmp_path / 'r.py'}:f", "rewards.0.function")
    assert fn([], ["a", "b"]) == [3, 3]
    assert import_string(f"{tmp_path / 'r.py'}:f", "x") is fn  # loaded once
    (tmp_path / "bad.py").write_text("1/0\n")
    with pytest.raises(ConfigError, match=r"rewards.1.function: cannot load .*ZeroDivisionError"):
        import_string(f"{tmp_path / 'bad.py'}:f", "rewards.1.function")
    with pytest.raises(ConfigError, match="rewards.2.function: no such file"):
        import_string(f"{tmp_path / 'missing.py'}:f", "rewards.2.function")
    with pytest.raises(ConfigError, match="has no attribute 'g'"):
        import_string(f"{tmp_path / 'r.py'}:g", "rewards.0.function")


# ------------------------------------------------------------------------------------------ runs
def _sse(response: httpx.Response) -> list[tuple[str, str, str]]:
    """(event, id, data) of each event in a text/event-stream body."""
    out = []
    for block in response.text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields.get("id", ""), fields.get("data", "")))
    return out


def _stream(srv, run_id: str, last_id: str | None = None, follow: int = 0, timeout: float = 30) -> list:
    headers = {**AUTH, **({"Last-Event-ID": last_id} if last_id else {})}
    with httpx.Client(base_url=srv.url, trust_env=False, timeout=timeout) as c:
        r = c.get(f"/api/runs/{run_id}/events?follow={follow}", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return _sse(r)


def test_sse_resumes_from_last_event_id_without_duplicates(server, runs_dir):
    run = runs_dir / "past-run"
    run.mkdir()
    rows = [{"step": i, "reward/mean": i / 10} for i in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "samples.jsonl").write_text(json.dumps({"step": 1, "completion": "42"}) + "\n")
    first = _stream(server, "past-run")
    assert [e[0] for e in first] == ["status", "metrics", "metrics", "metrics", "samples", "status"]
    assert [json.loads(e[2]) for e in first[1:4]] == rows
    assert json.loads(first[-1][2])["status"] == "unknown" and json.loads(first[-1][2])["step"] == 3
    # reconnect after the second metrics row: the rest, once
    resumed = _stream(server, "past-run", last_id=first[2][1])
    assert [e[1:] for e in resumed if e[0] != "status"] == [e[1:] for e in first[3:5]]
    # the file grows, with a half-written line at the end: only whole lines, each once
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4}) + "\n" + '{"step": 5, "rew')
    cursor = first[-1][1]
    more = [e for e in _stream(server, "past-run", last_id=cursor) if e[0] == "metrics"]
    assert [json.loads(e[2])["step"] for e in more] == [4]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('ard/mean": 0.5}\n')
    last = [e for e in _stream(server, "past-run", last_id=more[-1][1]) if e[0] == "metrics"]
    assert [json.loads(e[2]) for e in last] == [{"step": 5, "reward/mean": 0.5}]
    assert int(last[-1][1].split(".")[0]) == (run / "metrics.jsonl").stat().st_size
    with httpx.Client(base_url=server.url, trust_env=False, timeout=10) as c:
        bad = c.get("/api/runs/past-run/events", headers={**AUTH, "Last-Event-ID": "12"})
        assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]
        assert c.get("/api/runs/..%2F..%2Fetc/events", headers=AUTH).status_code == 404


def test_launched_tiny_run_finishes_and_streams_its_metrics(server, tmp_path_factory):
    from tokenmill.recipes import MODEL
    from tokenmill.testing import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("qs") / "model", seed=0, **MODEL)
    config = {"model": {"path": str(model), "device": "cpu"},
              "data": {"task": "addition", "num_train": 64, "num_eval": 4},
              "generation": {"group_size": 2, "max_tokens": 4},
              "controller": {"steps": 3, "prompts_per_step": 2}, "checkpoint": {"save_final": False}}
    code = "def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n"
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30, headers=AUTH) as c:
        r = c.post("/api/runs", json={"mode": "rl", "config": config, "name": "tiny",
                                      "rewards": [{"name": "short", "code": code, "function": "short"}]})
    assert r.status_code == 201, r.text
    launched = r.json()
    assert launched["argv"][-2:] == ["train", str(Path(launched["output_dir"]) / "run.yaml")]
    written = yaml.safe_load((Path(launched["output_dir"]) / "run.yaml").read_text())
    assert written["rewards"][0]["function"] == f"{launched['output_dir']}/rewards/short.py:short"
    events = _stream(server, launched["id"], follow=1, timeout=240)
    statuses = [json.loads(d) for e, _, d in events if e == "status"]
    metrics = [json.loads(d) for e, _, d in events if e == "metrics"]
    log = "".join(json.loads(d)["line"] + "\n" for e, _, d in events if e == "log")
    assert statuses[-1]["status"] == "finished" and statuses[-1]["returncode"] == 0, log
    trained = [m for m in metrics if "reward/mean" in m]
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in trained] == [1, 2, 3] and [m["step"] for m in evals] == [0, 3]
    assert len(metrics) == 5 and metrics[-1] == evals[-1]  # the held-out evaluation comes last
    assert all("reward/short/mean" in m and "timing_s/generate" in m and "bottleneck" in m for m in trained)
    assert any(e == "samples" for e, _, _ in events)
    ids = [i for _, i, _ in events]
    assert len(set(ids[1:-1])) == len([e for e in events[1:-1] if e[0] != "status"])  # one id per line
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30, headers=AUTH) as c:
        listed = {x["id"]: x for x in c.get("/api/runs").json()["runs"]}
    run = listed[launched["id"]]
    assert run["status"] == "finished" and run["step"] == 3
    # the Runs page's reward is the last training step's, not the final evaluation's (which has none)
    assert run["last_metrics"] == trained[-1] and run["last_eval"] == evals[-1]


def test_stop_a_run(client, tiny_model_path):
    config = {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
              "controller": {"steps": 100000}}
    launched = client.post("/api/runs", json={"mode": "rl", "config": config}).json()
    start = time.monotonic()
    stopped = client.post(f"/api/runs/{launched['id']}/stop").json()
    assert stopped == {"id": launched["id"], "status": "stopped"}
    assert time.monotonic() - start < 15
    info = client.get(f"/api/runs/{launched['id']}").json()
    assert info["status"] == "stopped" and info["returncode"] != 0 and info["config"]["controller"]["steps"] == 100000
    assert client.post("/api/runs/nope/stop").status_code == 404
    assert client.post("/api/runs", json={"mode": "rl", "config": {"model": {}}}).status_code == 422


def test_stage_estimate_lays_the_last_step_end_to_end():
    from tokenmill.composer.runs import estimate_stage

    row = {"timing_s/generate": 2.0, "timing_s/reward": 1.0, "timing_s/train": 3.0, "timing_s/sync": 0.5}
    got = [estimate_stage(row, t) for t in (0.5, 2.5, 4.0, 6.2, 7.0)]  # 7.0 = 0.5 into the next step
    assert got == ["generate", "reward", "train", "sync", "generate"]
    assert estimate_stage(None, 3.0) == "starting"


def test_preview_scores_with_a_judge_from_the_config(client, tiny_model_path):
    from tokenmill.testing.judge import ScriptedJudge

    judge = ScriptedJudge(reply=lambda content: "<score>8</score>")
    try:
        config = {"model": {"path": tiny_model_path}, "data": {"task": "addition"}, "generation": {"max_tokens": 4},
                  "rewards": [{"type": "judge", "url": judge.url, "model": "m", "rubric": "is it a number?"}]}
        out = client.post("/api/rewards/preview", json={"mode": "rl", "config": config, "prompts": 2, "samples": 2})
        assert out.status_code == 200, out.text
        samples = out.json()["samples"]
        assert len(samples) == 4 and all(s["scores"]["judge"] == pytest.approx(0.8) for s in samples)
        assert 1 <= judge.requests <= 4  # one per distinct completion
    finally:
        judge.close()


def test_the_memory_card_counts_a_qwen3_vl_tower_and_its_image_tokens(client, qwen3_vl_path):
    """The Composer's memory card reads a Qwen3-VL folder: its vision tower and a picture's image tokens."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    config = {"model": {"path": qwen3_vl_path, "device": "cpu"}, "data": {"task": "shapes"}}
    r = client.post("/api/estimate", json={"mode": "rl", "config": config})
    assert r.status_code == 200, r.text
    model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(qwen3_vl_path))
    vision = r.json()["vision"]
    assert vision["params"] == sum(p.numel() for p in model.model.visual.parameters())
    assert (vision["image_tokens"], vision["image_size"]) == (16, [448, 448])  # scaled down to 64 x 64 pixels
