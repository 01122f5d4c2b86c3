"""Remote environments: a real uvicorn server on loopback, a real HTTP client, no mocks.

The environments below run in this process (the server is a thread), so a test can see what the server did
to them (e.g. that they were closed) as well as what the client got back.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import httpx
import pytest

from tokenmill.envs.base import StepResult, as_messages, as_step_result, call
from tokenmill.envs.remote import RemoteEnvError, RemoteEnvironment, remote_factory
from tokenmill.envs.server import create_app, load_factory, serve
from tokenmill.serving import start_in_thread

CLOSED: list[str] = []  # names of environments whose close() ran (server side)


# ------------------------------------------------------------------------------------------ environments
class Guess:
    """Guess a number in [0, 100) drawn from the task's seed: observations say higher / lower."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.seed = task["seed"]
        self.target = random.Random(self.seed).randrange(100)
        self.turns = 0
        return [{"role": "system", "content": "Guess my number."},
                {"role": "user", "content": f"Seed {self.seed}: a number in [0, 100), é ✓"}]

    def step(self, message: dict[str, Any]) -> StepResult:
        self.turns += 1
        guess = int(message["content"])
        calls = len(message.get("tool_calls", []))
        if guess == self.target:
            return StepResult([], 1.0, True, {"turns": self.turns, "solved": True})
        hint = "higher" if guess < self.target else "lower"
        done = self.turns >= 6
        return StepResult([{"role": "user", "content": f"{hint} (seed {self.seed}, {calls} tool calls)"}],
                          -0.125, done, {"turns": self.turns, "history": [guess, hint], "nested": {"x": None}})

    def close(self) -> None:
        CLOSED.append(f"guess-{self.seed}")


class AsyncGuess(Guess):
    """The same game with coroutine methods that yield to the loop (episodes interleave on the server)."""

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:  # type: ignore[override]
        await asyncio.sleep(random.random() * 0.01)
        return Guess.reset(self, task)

    async def step(self, message: dict[str, Any]) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(random.random() * 0.01)
        return Guess.step(self, message)


class Boom(Guess):
    def step(self, message: dict[str, Any]) -> StepResult:
        raise ValueError(f"boom: bad move {message['content']}")

    def close(self) -> None:
        CLOSED.append(f"boom-{self.seed}")


class Hang(Guess):
    async def step(self, message: dict[str, Any]) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(float(message["content"]))
        return StepResult([{"role": "user", "content": "slept"}], 0.0, False, {})


class Weird(Guess):
    """`info` that JSON cannot hold as is."""

    def step(self, message: dict[str, Any]) -> StepResult:
        return StepResult([{"role": "user", "content": "ok"}], 0.5, False,
                          {"nan": float("nan"), "obj": Opaque(), "tuple": (1, 2), 3: "int key", "set": {7}})


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


KINDS: dict[str, type] = {"guess": Guess, "async": AsyncGuess, "boom": Boom, "hang": Hang, "weird": Weird}


class Dispatch:
    """One server for all the kinds above: the task's "kind" picks the environment for the episode."""

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.env = KINDS[task.get("kind", "guess")]()
        return await call(self.env.reset, task)

    async def step(self, message: dict[str, Any]) -> StepResult:
        return await call(self.env.step, message)

    async def close(self) -> None:
        await call(self.env.close)


# ------------------------------------------------------------------------------------------ fixtures
def run(coro: Any, timeout_s: float = 15.0) -> Any:
    """Run a test coroutine with a hard limit: a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def server():
    srv, thread = start_in_thread(create_app(Dispatch, step_timeout_s=0.5))
    yield srv
    srv.stop()
    assert not thread.is_alive()


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health").json()


def script(seed: int) -> list[dict[str, Any]]:
    """Assistant turns for an episode: a fixed guess list (so both sides see the same messages)."""
    guesses = [50, 25, 75, random.Random(seed).randrange(100), 10, 90]
    return [{"role": "assistant", "content": str(g), "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "noop", "arguments": "{}"}}] * (g % 3)} for g in guesses]


async def play(env: Any, task: dict[str, Any]) -> tuple[list[Any], list[StepResult]]:
    first = as_messages(await call(env.reset, task))
    results = []
    try:
        for message in script(task["seed"]):
            result = as_step_result(await call(env.step, message))
            results.append(result)
            if result.done:
                break
    finally:
        await call(env.close)
    return first, results


# ------------------------------------------------------------------------------------------ tests
def test_remote_episode_matches_in_process(server):
    for seed in (0, 1, 7):
        task = {"kind": "guess", "seed": seed}
        local = run(play(Guess(), task))
        remote = run(play(RemoteEnvironment(server.url), task))
        assert remote == local
        assert remote[1][-1].done and remote[1][-1].reward == 1.0  # the scripted 4th guess always wins
        assert any("2 tool calls" in m["content"] for r in remote[1] for m in r.observation)
    assert health(server.url)["episodes"] == 0  # finished episodes are forgotten ...
    assert CLOSED.count("guess-7") == 2  # ... and closed (once in-process, once by the server)


def test_concurrent_episodes_stay_separate(server):
    seeds = list(range(100, 116))

    async def main() -> list[Any]:
        return await asyncio.gather(*(play(RemoteEnvironment(server.url), {"kind": "async", "seed": s})
                                      for s in seeds))

    remote = run(main())
    local = [run(play(Guess(), {"seed": s})) for s in seeds]
    assert remote == local
    assert health(server.url)["episodes"] == 0


def test_environment_error_fails_only_its_episode(server):
    async def main() -> None:
        env = RemoteEnvironment(server.url)
        await env.reset({"kind": "boom", "seed": 3})
        with pytest.raises(RemoteEnvError, match=r"ValueError: boom: bad move 42") as info:
            await env.step({"role": "assistant", "content": "42"})
        assert info.value.status == 500 and info.value.episode_id == env.episode_id
        assert server.url in str(info.value) and env.episode_id in str(info.value)
        await env.close()
        assert isinstance(info.value, EnvironmentError)
        assert await play(RemoteEnvironment(server.url), {"seed": 5}) == await play(Guess(), {"seed": 5})

    run(main())
    assert "boom-3" in CLOSED and health(server.url)["episodes"] == 0


def test_hung_step_times_out_with_504(server):
    async def main() -> float:
        env = RemoteEnvironment(server.url)
        await env.reset({"kind": "hang", "seed": 0})
        start = time.perf_counter()
        with pytest.raises(RemoteEnvError, match="HTTP 504: step timed out after 0.5s") as info:
            await env.step({"role": "assistant", "content": "30"})
        await env.close()
        assert info.value.status == 504
        return time.perf_counter() - start

    assert run(main()) < 0.5 + 1.5
    assert health(server.url)["episodes"] == 0


def test_unserialisable_info_is_coerced(server):
    async def main() -> StepResult:
        env = RemoteEnvironment(server.url)
        await env.reset({"kind": "weird", "seed": 0})
        try:
            return await env.step({"role": "assistant", "content": "1"})
        finally:
            await env.close()

    result = run(main())
    assert result.info == {"nan": "nan", "obj": "Opaque()", "tuple": [1, 2], "3": "int key", "set": [7]}
    assert result.reward == 0.5


def test_http_errors_are_json_in_openai_shape(server):
    with httpx.Client(base_url=server.url) as client:
        r = client.post("/episodes/nope/step", json={"message": {"role": "assistant", "content": "1"}})
        assert r.status_code == 404 and "unknown episode" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "not_found_error"
        assert client.delete("/episodes/nope").status_code == 404
        r = client.post("/episodes", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/episodes", json={"tsk": {}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task"
        r = client.post("/episodes", json={"task": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task"
        r = client.post("/episodes", json={"task": {"seed": 1}})
        episode_id = r.json()["episode_id"]
        r = client.post(f"/episodes/{episode_id}/step", json={"message": "5"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "message"
        assert client.delete(f"/episodes/{episode_id}").json() == {"episode_id": episode_id, "closed": True}
        assert client.delete(f"/episodes/{episode_id}").status_code == 404
        assert client.get("/no/such/route").json()["error"]["message"] == "Not Found"


def test_host_header_checked(server):
    with httpx.Client(base_url=server.url) as client:
        for host in ("evil.example", "evil.example:8765", "127.0.0.1.evil.example", "[::2]:1", "localhost:x"):
            r = client.get("/health", headers={"Host": host})
            assert r.status_code == 400, host
            assert r.json()["error"]["param"] == "Host" and "Host header not allowed" in r.json()["error"]["message"]
        for host in ("localhost", "LOCALHOST:1", "127.0.0.1:8765", "[::1]:80", "[::1]"):
            assert client.get("/health", headers={"Host": host}).status_code == 200, host


def test_bearer_token():
    srv, _ = start_in_thread(create_app(Guess, token="s3cret"))
    try:
        with httpx.Client(base_url=srv.url) as client:
            body = {"task": {"seed": 1}}
            assert client.get("/health").status_code == 200  # open, for load balancers and probes
            r = client.post("/episodes", json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert client.post("/episodes", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert client.post("/episodes", json=body, headers={"Authorization": "s3cret"}).status_code == 401
            r = client.post("/episodes", json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200
            assert client.delete(f"/episodes/{r.json()['episode_id']}").status_code == 401

        async def main() -> None:
            with pytest.raises(RemoteEnvError, match="HTTP 401") as info:
                await RemoteEnvironment(srv.url).reset({"seed": 1})
            assert info.value.status == 401
            assert await play(RemoteEnvironment(srv.url, token="s3cret"), {"seed": 1}) == await play(
                Guess(), {"seed": 1})

        run(main())
    finally:
        srv.stop()


def test_episode_limit_and_idle_ttl():
    srv, _ = start_in_thread(create_app(Guess, max_episodes=2, episode_ttl_s=0.3))
    try:
        with httpx.Client(base_url=srv.url) as client:
            ids = [client.post("/episodes", json={"task": {"seed": i}}).json()["episode_id"] for i in range(2)]
            r = client.post("/episodes", json={"task": {"seed": 2}})
            assert r.status_code == 429 and "max_episodes=2" in r.json()["error"]["message"]
            assert client.delete(f"/episodes/{ids[0]}").status_code == 200
            assert client.post("/episodes", json={"task": {"seed": 3}}).status_code == 200
            time.sleep(0.4)  # both live episodes are now idle past the TTL: the next open reaps them
            assert client.post("/episodes", json={"task": {"seed": 4}}).status_code == 200
            assert client.get("/health").json()["episodes"] == 1
            step = client.post(f"/episodes/{ids[1]}/step", json={"message": {"role": "assistant", "content": "1"}})
            assert step.status_code == 404
    finally:
        srv.stop()


def test_server_gone_mid_episode():
    srv, thread = start_in_thread(create_app(Guess))

    async def main() -> None:
        env = RemoteEnvironment(srv.url, retries=2, backoff_s=0.05)
        await env.reset({"seed": 1})
        await asyncio.to_thread(srv.stop)
        assert not thread.is_alive()
        start = time.perf_counter()
        with pytest.raises(RemoteEnvError, match="step failed") as info:
            await env.step({"role": "assistant", "content": "1"})
        assert info.value.status is None and info.value.episode_id == env.episode_id
        assert time.perf_counter() - start < 2.0  # an error, not a hang (and no retries of a step)
        await env.close()  # the server is gone: close logs, it does not raise

        start = time.perf_counter()
        with pytest.raises(RemoteEnvError, match=r"reset failed: .*after 3 attempts"):
            await RemoteEnvironment(srv.url, retries=2, backoff_s=0.05).reset({"seed": 1})
        assert time.perf_counter() - start >= 0.05 + 0.1  # it backed off between its attempts

    run(main())


def test_server_stopped_during_a_step():
    srv, _ = start_in_thread(create_app(Hang, step_timeout_s=10), graceful_timeout_s=0.3)

    async def main() -> float:
        env = RemoteEnvironment(srv.url)
        await env.reset({"seed": 0})
        stepping = asyncio.create_task(env.step({"role": "assistant", "content": "5"}))
        await asyncio.sleep(0.2)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        start = time.perf_counter()
        with pytest.raises(RemoteEnvError, match="step failed"):
            await stepping
        await asyncio.to_thread(stopper.join)
        await env.close()
        return time.perf_counter() - start

    assert run(main()) < 3.0


def test_serve_refuses_exposure_and_bad_specs():
    spec = f"{__name__}:Guess"
    # the message names the CLI's flags (`tokenmill env serve --allow-remote --token ...`)
    with pytest.raises(ValueError, match="pass --allow-remote together with --token"):
        serve(spec, host="0.0.0.0")
    with pytest.raises(ValueError, match="pass --allow-remote together with --token"):
        serve(spec, host="0.0.0.0", allow_remote=True)
    with pytest.raises(ValueError, match="--token: must not be empty"):
        serve(spec, host="127.0.0.1", token="")
    with pytest.raises(ValueError, match="non-loopback"):
        serve(spec, host="10.1.2.3", token="t")
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        serve("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="has no attribute"):
        load_factory(f"{__name__}:Nope")
    with pytest.raises(ValueError, match="must look like"):
        load_factory("Guess")
    assert load_factory(spec) is Guess
    assert isinstance(load_factory(spec, {})(), Guess)
    assert load_factory(f"{__name__}:Dispatch", {}) is Dispatch


def test_client_argument_checks():
    with pytest.raises(ValueError, match="http"):
        RemoteEnvironment("ftp://host:1")
    with pytest.raises(ValueError):
        remote_factory("http://127.0.0.1:1", retries=-1)
    factory = remote_factory("http://127.0.0.1:1/", token="t", timeout_s=5)
    env = factory()
    assert isinstance(env, RemoteEnvironment) and env.url == "http://127.0.0.1:1" and env.token == "t"
    with pytest.raises(RuntimeError, match="before reset"):
        run(env.step({"role": "assistant", "content": "1"}))


def test_a_task_lacking_a_field_reset_reads_is_a_400_naming_it(caplog):
    """`guess_number`'s reset reads task["high"]: a client task without it is the client's mistake (400, `param`
    task.high), not a server failure (500 with a traceback in the log); the server keeps serving."""
    from tokenmill.envs.guess import GuessNumberEnv

    srv, _ = start_in_thread(create_app(GuessNumberEnv))
    try:
        with httpx.Client(base_url=srv.url) as client:
            r = client.post("/episodes", json={"task": {"prompt": "1-20", "secret": 7}})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "task.high" and error["type"] == "invalid_request_error"
            assert error["message"].startswith("task.high: missing; ") and "['prompt', 'secret']" in error["message"]
            assert client.get("/health").json()["episodes"] == 0
            ok = client.post("/episodes", json={"task": {"secret": 7, "high": 20}})
            assert ok.status_code == 200 and ok.json()["observation"][-1]["content"] == "1-20"
    finally:
        srv.stop()
    assert not any(r.exc_info for r in caplog.records if r.name == "tokenmill.envs.server")


class Rewrites:
    """Each step replaces the conversation with the task message and the latest turn (`StepResult.history`)."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.first = {"role": "user", "content": f"task {task['seed']}"}
        return [self.first]

    def step(self, message: dict[str, Any]) -> StepResult:
        return StepResult(observation=[{"role": "user", "content": "more"}], reward=0.5, done=False,
                          history=[self.first, {"role": "assistant", "content": message["content"]}])


def test_a_rewritten_history_crosses_the_wire():
    srv, _ = start_in_thread(create_app(Rewrites))
    try:
        async def main() -> None:
            env = RemoteEnvironment(srv.url)
            await env.reset({"seed": 3})
            result = await env.step({"role": "assistant", "content": "42"})
            await env.close()
            assert result.history == [{"role": "user", "content": "task 3"}, {"role": "assistant", "content": "42"}]
            assert result.observation == [{"role": "user", "content": "more"}] and result.reward == 0.5

        run(main())
    finally:
        srv.stop()
