"""Connection limits (`tokenmill.serving_limits`) on real loopback servers and raw sockets: slow and silent
clients are closed after the read timeout, open connections stay under the cap during a flood, `/health`
stays fast meanwhile, and answers (a stream, a slow generation) are never timed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill import serving
from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app as engine_app
from tokenmill.serving_limits import ConnectionLimits, LimitsError, default_max_connections

TIMEOUT_S = 0.5
SLACK_S = 1.0  # a loaded CI machine; "never closed" shows as the socket's 5 s timeout


def _protocols() -> list:
    found = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return found
    return [*found, pytest.param(HttpToolsProtocol, id="httptools")]


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            for i in range(8):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.15)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(params=_protocols())
def server(request):
    srv, _ = serving.start_in_thread(_app(), limits=ConnectionLimits(read_timeout_s=TIMEOUT_S, max_connections=3),
                                     http=request.param)
    yield srv
    srv.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(5)
    return sock


def _wait_closed(sock: socket.socket) -> tuple[float, bytes]:
    """(seconds until the server closed `sock`, what it sent first)."""
    start, got = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return time.monotonic() - start, got


def test_limits_are_checked_and_the_default_cap_follows_the_file_limit():
    with pytest.raises(LimitsError, match="read_timeout_s: must be > 0"):
        ConnectionLimits(read_timeout_s=0)
    with pytest.raises(LimitsError, match="max_connections: must be at least 1"):
        ConnectionLimits(max_connections=0)
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert ConnectionLimits().cap == default_max_connections() <= 1000
    assert default_max_connections() == max(16, min(1000, soft // 2))
    assert ConnectionLimits(max_connections=7).cap == 7


def test_silent_and_trickling_clients_are_closed_after_the_read_timeout(server):
    silent = _connect(server.port)
    trickle = _connect(server.port)
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.1 s: each gap is well under the timeout, the head never completes
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100:
            if stop.wait(0.1):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    waited, got = _wait_closed(silent)
    assert TIMEOUT_S - 0.1 < waited < TIMEOUT_S + SLACK_S and got == b""
    waited, got = _wait_closed(trickle)
    stop.set()
    assert waited < TIMEOUT_S + SLACK_S  # the head's deadline is fixed: trickling bytes do not extend it
    assert got.startswith(b"HTTP/1.1 408") or got == b""  # a reset may beat the 408 to the reader
    assert server.slots.timed_out == 2


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(server):
    sock = _connect(server.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    time.sleep(0.1)
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # then nothing: uvicorn's keep-alive (30 s) no longer applies
    waited, got = _wait_closed(sock)
    assert waited < TIMEOUT_S + SLACK_S and got.startswith(b"HTTP/1.1 408")


def test_answers_are_not_timed_and_a_body_that_keeps_coming_is_read(server):
    with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as client:
        start = time.monotonic()
        with client.stream("GET", "/stream") as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events == [f"data: {i}" for i in range(8)] and time.monotonic() - start > 2 * TIMEOUT_S

        def slow_body():
            for _ in range(6):  # 6 x 0.25 s = 1.5 s in all, longer than the timeout, never a gap as long as it
                time.sleep(0.25)
                yield b"x" * 10

        r = client.post("/upload", content=slow_body())
        assert r.status_code == 200 and r.json() == {"bytes": 60}


def test_a_body_that_stalls_is_closed(server):
    sock = _connect(server.port)
    sock.sendall(b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    waited, got = _wait_closed(sock)
    assert waited < TIMEOUT_S + SLACK_S and b"200" not in got
    assert server.slots.timed_out == 1


def test_at_the_cap_the_slowest_connection_makes_room_and_busy_ones_are_kept(server):
    """Cap 3: three silent clients, then a probe: the oldest silent one goes, the probe is answered at once.
    Three long answers in flight and a fourth client: nothing can go, the newcomer is answered 503."""
    silent = [_connect(server.port) for _ in range(3)]
    time.sleep(0.05)
    start = time.monotonic()
    r = httpx.get(f"{server.url}/health", timeout=5, trust_env=False)
    assert r.status_code == 200 and time.monotonic() - start < 1.0
    waited, _ = _wait_closed(silent[0])
    assert waited < 0.5 and server.slots.evicted >= 1
    for sock in silent:
        sock.close()
    time.sleep(0.05)

    streams = [_connect(server.port) for _ in range(3)]
    for sock in streams:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    _, got = _wait_closed(_connect(server.port))
    assert got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
    assert server.slots.refused == 1
    for sock in streams:  # the three answers were not cut
        rest = b""
        while b"data: 7" not in rest:
            rest += sock.recv(4096)
        sock.close()


def test_the_engine_servers_token_stream_outlives_a_short_read_timeout(tiny_model_path):
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=4)
    limits = ConnectionLimits(read_timeout_s=0.05, max_connections=8)
    server, _ = serving.start_in_thread(engine_app(engine, model_name="tiny"), limits=limits)
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "temperature": 1.0,
                "seed": 5}  # seed 5 runs to max_tokens on the tiny model
        start = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60, trust_env=False) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) > 100
        assert time.monotonic() - start > limits.read_timeout_s and server.slots.timed_out == 0
    finally:
        server.stop()
        engine.close()


# ------------------------------------------------------------------------------------------ a real flood
def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_a_flood_of_slow_clients_leaves_health_fast_and_handles_under_the_cap(tmp_path):
    """`tokenmill env serve --read-timeout-s 1 --max-connections 50`, 300 clients that connect and send nothing
    or trickle a request line: each is closed within the timeout (most at once, to make room), the server's
    open files stay under the cap plus a constant, and a probe's /health is answered within a second."""
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "env", "serve", "guess_number", "--port", "0",
                             "--read-timeout-s", "1", "--max-connections", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    socks: list[tuple[socket.socket, float]] = []
    try:
        port = serving.wait_for_port(proc, timeout_s=60)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=10, trust_env=False).status_code == 200
        base, peak, latencies, stop = _open_fds(proc.pid), [0], [], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _open_fds(proc.pid))
                time.sleep(0.002)

        def probe() -> None:
            while not stop.wait(0.1):
                start = time.monotonic()
                r = httpx.get(f"{url}/health", headers={"Connection": "close"}, timeout=10, trust_env=False)
                latencies.append((time.monotonic() - start, r.status_code))

        threads = [threading.Thread(target=f, daemon=True) for f in (sample, probe)]
        for t in threads:
            t.start()
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.setblocking(False)
            socks.append((sock, time.monotonic()))
            if i % 2:
                sock.send(b"GET /hea")
        lives = _watch(socks, seconds=3.0)
        stop.set()
        for t in threads:
            t.join(10)
        assert len(lives) == 300, f"{300 - len(lives)} connections still open after 3 s"
        assert max(lives) < 1.0 + SLACK_S
        assert peak[0] <= base + 50 + 10, (base, peak[0])
        assert latencies and {code for _, code in latencies} == {200}
        assert max(t for t, _ in latencies) < 1.0, latencies
    finally:
        for sock, _ in socks:
            sock.close()
        proc.terminate()
        proc.wait(10)


def _watch(socks: list[tuple[socket.socket, float]], *, seconds: float) -> list[float]:
    """How long each socket lived until the server closed it, watched for at most `seconds`; the slow ones
    send a byte now and then."""
    closed: dict[int, float] = {}
    deadline = time.monotonic() + seconds
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for i, (sock, opened) in enumerate(socks):
            if i in closed:
                continue
            try:
                if sock.recv(4096) == b"":
                    closed[i] = time.monotonic() - opened
                elif i % 2:
                    sock.send(b"l")
            except BlockingIOError:
                pass
            except OSError:
                closed[i] = time.monotonic() - opened
        time.sleep(0.05)
    return list(closed.values())
