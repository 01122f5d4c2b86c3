"""Composer security, against a real uvicorn server on a loopback port: token on every route, Host and Origin
checks, the loopback-only CLI default, and reward code cut by its timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from tokenmill.composer.app import create_app, host_name
from tokenmill.serving import start_in_thread

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app = create_app(TOKEN, tmp_path_factory.mktemp("runs"))
    srv, _ = start_in_thread(app)
    yield srv, app
    srv.stop()


def _client(srv, **kw) -> httpx.Client:
    return httpx.Client(base_url=srv.url, trust_env=False, timeout=60, **kw)


def _api_routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if path.startswith("/api"):
            for method in sorted(route.methods - {"HEAD"}):
                out.append((method, re.sub(r"\{[^}]+\}", "some-id", path)))
    return out


def test_every_api_route_needs_the_token(server):
    srv, app = server
    routes = _api_routes(app)
    assert len(routes) >= 12  # schema, presets, validate, diagram, yaml x2, estimate, preview, runs x5
    with _client(srv) as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "tm_token=wrong"}):
                r = c.request(method, path, json={}, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert "token" in r.json()["error"]
        assert c.get("/").status_code == 401  # the page too
        assert c.get("/static/app.js").status_code == 401
        ok = c.get("/api/presets", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and [p["id"] for p in ok.json()] == [
            "laptop_cpu", "gpu_24gb", "gpu_80gb", "node_8xh100"]


def test_token_url_sets_a_strict_httponly_cookie(server):
    srv, _ = server
    with _client(srv) as c:
        assert c.get("/?token=wrong", follow_redirects=False).status_code == 401
        r = c.get(f"/?token={TOKEN}", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and f"tm_token={TOKEN}".lower() in cookie
        # the client now holds the cookie: the API answers without a header
        assert c.get("/api/schema?mode=sft").json()["mode"] == "sft"


def test_bad_host_is_refused_even_with_the_token(server):
    srv, _ = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with _client(srv) as c:
        for host in ("evil.example", "127.0.0.1.evil.example:80", "attacker.com:8600"):
            r = c.get("/api/presets", headers={**auth, "Host": host})
            assert r.status_code == 400 and "Host" in r.json()["error"], host  # 400, as on every server
        assert c.get("/api/presets", headers={**auth, "Host": "localhost:1234"}).status_code == 200
    assert host_name("[::1]:8600") == "::1" and host_name("LocalHost") == "localhost" and host_name("a:b") == ""


def test_cross_origin_post_is_refused(server):
    srv, _ = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"mode": "rl", "config": {"model": {"path": "m"}, "data": {"task": "addition"}}}
    with _client(srv) as c:
        r = c.post("/api/validate", json=body, headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]
        r = c.post("/api/runs", json=body, headers={**auth, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        same = c.post("/api/validate", json=body, headers={**auth, "Origin": srv.url})
        assert same.status_code == 200 and same.json()["ok"] is True


def test_cli_refuses_a_non_loopback_host_without_the_flag(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "composer", "--host", "0.0.0.0", "--port", "0",
                           "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-remote" in lines[0] and "0.0.0.0" in lines[0]
    assert "token=" not in done.stdout  # nothing was served


def test_infinite_loop_reward_is_cut_by_the_timeout(server, tiny_model_path):
    srv, _ = server
    rewards = [
        {"name": "spin", "code": "def spin(prompts, completions, **kw):\n    while True:\n        pass\n",
         "function": "spin", "timeout_s": 1.0},
        {"name": "spin_at_import", "code": "while True:\n    pass\n", "function": "f", "timeout_s": 1.0},
        {"name": "ok", "code": "def ok(prompts, completions, **kw):\n    return [1.0] * len(completions)\n",
         "function": "ok"},
    ]
    body = {"mode": "rl", "config": {"model": {"path": tiny_model_path}, "data": {"task": "addition"},
                                     "generation": {"max_tokens": 4}},
            "rewards": rewards, "prompts": 2, "samples": 2}
    with _client(srv, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        start = time.monotonic()
        r = c.post("/api/rewards/preview", json=body)
        elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    out = r.json()
    by_name = {x["name"]: x for x in out["rewards"]}
    for name in ("spin", "spin_at_import"):
        assert "no result within 1s" in by_name[name]["error"]
        # cut at the timeout, not later: a batch that times out is narrowed, with at most three timed-out calls
        assert 0.9 <= by_name[name]["seconds"] < 3 * 1.0 + 1.5
    assert by_name["spin"]["error"].endswith("; spin (<reward spin>:1)")  # the page's code, not tokenmill's
    assert elapsed < 30  # model load + sampling + the timeouts
    assert len(out["samples"]) == 4
    for s in out["samples"]:
        assert s["scores"]["spin"] is None and "no result within" in s["errors"]["spin"]
        assert s["scores"]["ok"] == 1.0  # the other rewards still score
