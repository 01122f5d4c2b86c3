"""The one serving layer (`tokenmill.serving`): host parsing, origins, exposure, the ready line, and the same
guard and body cap on all three servers (engine, environment, Composer), each on a real loopback server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tokenmill import serving
from tokenmill.composer.app import create_app as composer_app
from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app as engine_app
from tokenmill.envs.server import create_app as env_app
from tokenmill.serving import ExposureError, start_in_thread

TOKEN = "s3cret"
CAP = 64 * 1024


def test_host_names_are_parsed_one_way():
    assert serving.host_name("[::1]:8600") == "::1" and serving.host_name("LocalHost:1") == "localhost"
    assert serving.host_name("127.0.0.1") == "127.0.0.1"
    for bad in ("a:b", "::1", "[::1", "[::1]x", "host:99999", "", "a b", "a/b", "user@host"):
        assert serving.host_name(bad) == "", bad
    assert serving.is_loopback("127.8.0.1") and serving.is_loopback("[::1]") and serving.is_loopback("LOCALHOST")
    assert not serving.is_loopback("0.0.0.0") and not serving.is_loopback("localhost.evil.example")
    assert serving.bind_names("0.0.0.0") == ("*",) and serving.bind_names("[::]") == ("*",)
    assert serving.host_set(serving.bind_names("10.0.0.5")) == {"localhost", "127.0.0.1", "::1", "10.0.0.5"}


@pytest.mark.parametrize(("origin", "host", "same"), [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
    ("http://LOCALHOST:8000", "localhost:8000", True),
    ("http://localhost", "localhost:80", True),
    ("https://localhost", "localhost:443", True),
    ("http://[::1]:9", "[::1]:9", True),
    ("http://127.0.0.1:3000", "127.0.0.1:8000", False),  # another port is another origin
    ("http://localhost:8000", "127.0.0.1:8000", False),
    ("https://localhost", "localhost:80", False),
    ("null", "localhost:8000", False),
    ("file://", "localhost", False),
    ("http://localhost:x", "localhost", False),
])
def test_the_origin_check_compares_scheme_host_and_port(origin, host, same):
    assert serving.same_origin(origin, host) is same


def test_exposure_needs_the_flag_and_a_token_named_as_the_cli_names_them():
    serving.check_exposure("127.0.0.1", None, False)
    serving.check_exposure("0.0.0.0", "t", True)
    for token, allow in ((None, False), ("t", False), (None, True)):
        with pytest.raises(ExposureError, match="pass --allow-remote together with --token"):
            serving.check_exposure("0.0.0.0", token, allow)
    with pytest.raises(ExposureError, match="pass proxy.allow_remote together with proxy.token"):
        serving.check_exposure("10.0.0.1", None, True, flag="proxy.allow_remote", token_flag="proxy.token")
    with pytest.raises(ExposureError, match="--token: must not be empty"):
        serving.check_exposure("127.0.0.1", "", False)


def test_bind_picks_a_free_port_and_names_a_taken_one():
    sock = serving.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        assert port > 0
        with pytest.raises(ExposureError, match=f"cannot bind 127.0.0.1:{port}"):
            serving.bind("127.0.0.1", port).close()
    finally:
        sock.close()


def test_a_client_that_connects_before_the_server_runs_waits_instead_of_being_refused():
    """A server prints its URL right after `bind` (the Composer does), a moment before uvicorn serves: a client
    that connects in that moment must wait in the listening socket's backlog, not get "connection refused"."""
    sock = serving.bind("127.0.0.1", 0)
    try:
        socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5).close()
    finally:
        sock.close()


def test_the_ready_line_names_the_bound_port():
    line = serving.ready_line("tokenmill serve: tiny", "http://127.0.0.1:43210/v1", "auth off")
    assert line == "tokenmill serve: tiny ready on http://127.0.0.1:43210/v1 (auth off)"
    assert serving.read_port(line) == 43210
    assert serving.read_port("x ready on http://[::1]:9/v1") == 9
    assert serving.read_port("Loading weights: 100%") is None


@pytest.fixture(scope="module")
def three_servers(tiny_model_path, tmp_path_factory):
    """The engine, environment and Composer servers, each with a token and a 64 KiB body cap."""
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=4)
    apps = {
        "engine": (engine_app(engine, model_name="tiny", token=TOKEN, max_body_bytes=CAP), "/v1/completions"),
        "env": (env_app(lambda: None, token=TOKEN, max_body_bytes=CAP), "/episodes"),
        "composer": (composer_app(TOKEN, tmp_path_factory.mktemp("runs"), max_body_bytes=CAP), "/api/validate"),
    }
    servers = {name: (start_in_thread(app)[0], route) for name, (app, route) in apps.items()}
    yield servers
    for server, _ in servers.values():
        server.stop()
    engine.close()


def _message(r: httpx.Response) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error


@pytest.mark.parametrize("name", ["engine", "env", "composer"])
def test_one_guard_on_every_server(three_servers, name):
    server, route = three_servers[name]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as c:
        r = c.post(route, json={}, headers=auth | {"Host": "evil.example"})
        assert r.status_code == 400 and "Host header not allowed" in _message(r)  # DNS rebinding: 400 everywhere
        r = c.post(route, json={}, headers=auth | {"Origin": "http://127.0.0.1:1"})
        assert r.status_code == 403 and "cross-origin" in _message(r)
        assert c.post(route, json={}).status_code == 401
        big = b'{"x": "' + b"a" * CAP + b'"}'
        r = c.post(route, content=big, headers=auth | {"Content-Type": "application/json"})
        assert r.status_code == 413 and f"over {CAP} bytes" in _message(r)

        def chunked():  # no Content-Length: the guard counts the bytes as they arrive
            for _ in range(CAP // 1024 + 2):
                yield b" " * 1024

        r = c.post(route, content=chunked(), headers=auth | {"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.get("/health" if name != "composer" else "/api/presets", headers=auth).status_code == 200


def test_env_serve_prints_its_port_and_has_the_origin_check(tmp_path):
    """`tokenmill env serve --port 0` binds a free port and says which in its ready line; --max-body-mb caps bodies."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "env", "serve", "guess_number", "--port", "0",
                             "--max-body-mb", "0.001"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        port, deadline = None, time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the server exited before it was ready"
            port = serving.read_port(line)
        assert port
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        r = httpx.post(f"{url}/episodes", json={"task": {}}, headers={"Origin": "http://evil.example"}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["param"] == "Origin"
        r = httpx.post(f"{url}/episodes", json={"task": {"pad": "x" * 1100}}, timeout=10)
        assert r.status_code == 413 and "over 1048 bytes" in r.json()["error"]["message"]  # --max-body-mb 0.001
    finally:
        proc.terminate()
        proc.wait(10)


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_wait_for_port_reads_the_ready_line_and_keeps_the_log(tmp_path):
    proc = _python("import time; print('loading', flush=True); print('x ready on http://127.0.0.1:4321/v1', "
                   "flush=True); print('after', flush=True); time.sleep(0.2)")
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed by the pump when the output ends
    assert serving.wait_for_port(proc, timeout_s=30, log=log) == 4321
    proc.wait(10)
    deadline = time.monotonic() + 5
    while not log.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "server.log").read_text().splitlines() == ["loading", "x ready on http://127.0.0.1:4321/v1",
                                                                  "after"]
    with pytest.raises(ChildProcessError, match="exited with code 3"):
        serving.wait_for_port(_python("import sys; print('no'); sys.exit(3)"), timeout_s=30)
    slow = _python("import time; time.sleep(30)")
    try:
        with pytest.raises(TimeoutError, match="no ready line within 0.3s"):
            serving.wait_for_port(slow, timeout_s=0.3)
    finally:
        slow.kill()
        slow.wait()


def test_spawned_engine_servers_bind_port_zero_and_report_it(tiny_model_path, tmp_path):
    """`engine.placement: process` starts `tokenmill serve --port 0` and reads each port back: no free-port race."""
    from tokenmill.engines.server.app import spawn_servers

    urls, procs = spawn_servers(tiny_model_path, 1, threads=1, timeout_s=120, log_dir=tmp_path)
    try:
        assert len(urls) == 1
        for i, url in enumerate(urls):
            assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
            assert serving.read_port((tmp_path / f"server_{i}.log").read_text()) == int(url.rsplit(":", 1)[1])
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_env_serve_names_the_cli_flags_when_it_refuses_a_remote_bind(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "env", "serve", "guess_number", "--host", "0.0.0.0"],
                          check=False, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "pass --allow-remote together with --token" in done.stderr and "allow_remote=True" not in done.stderr


def test_an_empty_token_is_refused_when_the_app_is_made(tiny_model_path, tmp_path):
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=2)
    try:
        for make in (lambda: engine_app(engine, model_name="tiny", token=""), lambda: env_app(lambda: None, token=""),
                     lambda: composer_app("", tmp_path)):
            with pytest.raises(ValueError, match="non-empty"):
                make()
    finally:
        engine.close()
