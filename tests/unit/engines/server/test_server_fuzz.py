"""Hostile bodies against the engine and environment servers' JSON routes, on real loopback servers.

Hypothesis generates bodies (wrong types, huge and non-finite numbers, unknown keys, lone surrogates, deep
nesting) and hand-written cases add what a generator rarely hits (malformed JSON, invalid UTF-8, a 5 MB body).
Every answer must be a success or a 4xx in OpenAI's error shape, never a 5xx or plain text, and the server
must still be healthy afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.server.app import create_app as engine_app
from tokenmill.envs.base import StepResult
from tokenmill.envs.server import create_app as env_app
from tokenmill.serving import start_in_thread
from tokenmill.testing.http import check_error_shape as check

FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Echo:
    """Any task, any message: the env server's own checks are what is fuzzed, not an environment's."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": json.dumps(task)[:40]}]

    def step(self, message: dict[str, Any]) -> StepResult:
        return StepResult([], 0.0, False, {"len": len(json.dumps(message))})


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    engine = ContinuousEngine.from_pretrained(tiny_model_path, max_batch=8)
    server, _ = start_in_thread(engine_app(engine, model_name="tiny", request_timeout_s=30))
    with httpx.Client(base_url=server.url, timeout=60) as client:  # kept alive: the fuzz is about bodies
        yield client
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def env():
    server, _ = start_in_thread(env_app(Echo, max_episodes=10_000))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


@pytest.fixture(scope="module")
def episode(env) -> str:
    return env.post("/episodes", json={"task": {}}).json()["episode_id"]


def post(client: httpx.Client, route: str, raw: bytes, content_type: str = "application/json") -> httpx.Response:
    return client.post(route, content=raw, headers={"content-type": content_type})


def dump(value: Any) -> bytes:
    # surrogatepass: a lone surrogate goes out as JSON's own escape, as a hostile client would send it
    return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------------------------------ strategies
surrogates = st.sampled_from(["\ud800", "a\udfffb", "\ud83d"])
texts = st.text(max_size=12) | surrogates
numbers = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**70, -(2**70), 10**30]) | st.floats(allow_nan=True)
scalars = st.none() | st.booleans() | numbers | texts
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=8)
# max_tokens is kept small so that a body that happens to be valid answers at once
SAMPLING = {"temperature": values, "top_p": values, "top_k": values, "n": values | st.integers(-3, 2000),
            "stop": values, "seed": values | numbers, "stream": values, "logprobs": values, "model": values,
            "max_tokens": st.sampled_from([None, 0, -5, 1, 2, "2", 2.5, 2**70, [1]])}
prompts = values | st.lists(st.integers(-(2**70), 2**70), max_size=4) | texts


def body(required: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    known = st.fixed_dictionaries({}, optional={**SAMPLING, **required})
    return (known | st.dictionaries(texts, values, max_size=4) | values).map(dump)


messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), values, max_size=3)
                    | values, max_size=3)
ENGINE_ROUTES = {
    "/v1/completions": body({"prompt": prompts, "echo": values, "best_of": values}),
    "/v1/chat/completions": body({"messages": messages, "tools": values, "chat_template_kwargs": values,
                                  "max_completion_tokens": st.sampled_from([0, 1, "x", 2**70])}),
}


@pytest.mark.parametrize("route", list(ENGINE_ROUTES))
def test_generated_bodies_against_the_engine_server(engine, route):
    @FUZZ
    @given(raw=ENGINE_ROUTES[route])
    def run(raw: bytes) -> None:
        check(post(engine, route, raw))

    run()
    assert engine.get("/health").json()["status"] == "ok"


def test_generated_bodies_against_the_env_server(env, episode):
    @FUZZ
    @given(raw=body({"task": values}), step=body({"message": values}))
    def run(raw: bytes, step: bytes) -> None:
        check(post(env, "/episodes", raw))
        check(post(env, f"/episodes/{episode}/step", step))

    run()
    assert env.get("/health").json()["status"] == "ok"


HAND_WRITTEN = [
    b"", b"{", b"[1,", b"nul", b"null", b"[]", b'"prompt"', b"123", b"{}",
    b'{"prompt": "\xff\xfe\xfd"}', b'\xef\xbb\xbf{"prompt": "x"}', b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "n": 1.5}', b'{"messages": "hi"}', b'{"messages": [{"role": 1}]}',
    b'{"messages": [{"role": "user", "content": {"a": 1}}]}', b'{"prompt": [[[[1]]]]}',
    b'{"task": [], "message": 1}', b'{"task": {"a": "\\ud800"}}', b'{"message": null}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}',
    b'{"task": {"a": "' + b"x" * (5 * 2**20) + b'"}}',
]
ROUTES = [("engine", "/v1/completions"), ("engine", "/v1/chat/completions"), ("env", "/episodes"),
          ("env", "/episodes/{episode}/step")]


@pytest.mark.parametrize(("server", "route"), ROUTES)
def test_hand_written_bodies(engine, env, episode, server, route):
    client = engine if server == "engine" else env
    route = route.format(episode=episode)
    for raw in HAND_WRITTEN:
        answer = post(client, route, raw)
        check(answer)
        assert answer.status_code != 200 or len(raw) < 100, raw[:40]
        if len(raw) > 4 * 2**20:
            assert answer.status_code == 413, raw[:40]
    check(post(client, route, b'{"prompt": "x"}', content_type="text/plain"))
    assert client.get("/health").status_code == 200
