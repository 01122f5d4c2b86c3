"""`tokenmill env serve`: a real server process on loopback, driven by the real client."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx

from tokenmill.envs.base import call
from tokenmill.envs.guess import GuessNumberEnv
from tokenmill.envs.remote import RemoteEnvironment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TOKENMILL_ENV_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


async def _episode(env, task, guesses):
    out = [await call(env.reset, task)]
    for g in guesses:
        r = await call(env.step, {"role": "assistant", "content": str(g)})
        out.append((r.observation, r.reward, r.done))
        if r.done:
            break
    await call(env.close)
    return out


def test_env_serve_runs_a_builtin_that_matches_in_process():
    port = _free_port()
    proc = _cli("env", "serve", "guess_number", "--port", str(port), "--kwargs", '{"max_turns": 4}')
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        task = {"secret": 5, "high": 7}
        guesses = [1, 6, 5]
        remote = asyncio.run(_episode(RemoteEnvironment(url), task, guesses))
        local = asyncio.run(_episode(GuessNumberEnv(max_turns=4), task, guesses))
        assert remote == local
        assert remote[-1][1] == 1.0 and remote[-1][2] is True  # solved on the third guess
    finally:
        proc.terminate()
        proc.wait(30)


def test_env_serve_refuses_exposure_and_bad_specs_with_one_line():
    for args, expected in [
        (["no_such_module_xyz:Env"], "cannot import"),
        (["guess_number", "--host", "0.0.0.0"], "refusing to serve on non-loopback host"),
        (["guess_number", "--kwargs", "[1]"], "--kwargs: expected a JSON object"),
    ]:
        proc = _cli("env", "serve", *args, "--port", str(_free_port()))
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, out
        assert expected in out and "Traceback" not in out
