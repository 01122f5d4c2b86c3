"""OpenEnv environments through `tokenmill.envs.openenv`: a real OpenEnv server (OpenEnv's own app factory,
uvicorn on a loopback port, in a thread of this process) played through OpenEnv's own client, no stand-ins.

`Ledger` below records on the server side what it computed for every step (keyed by a session id that its
first observation tells the policy), so a test can check that what tokenmill saw is what the server said.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from tokenmill.envs.openenv import (
    OpenEnvEnvironment,
    OpenEnvError,
    client_class,
    environment_types,
    openenv_app,
    openenv_factory,
)
from tokenmill.serving import start_in_thread
from tokenmill.types import ConfigError

GUESS = f"{Path(__file__).parents[3] / 'examples' / 'openenv_guess' / 'env.py'}:GuessEnvironment"
LOG: dict[str, list[tuple[str, float, bool, str]]] = {}  # session -> (action text, reward, done, reply)


class LedgerAction(Action):
    text: str = Field(..., description="anything")


class LedgerObservation(Observation):
    reply: str = ""
    total: int = 0


class Ledger(Environment[LedgerAction, LedgerObservation, State]):
    """Counts the digits the policy writes: reward = the share of digits in the text; three steps. A text
    'boom' makes step raise, 'sleep' makes it slow; a reset with fail=True raises."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, fail: bool = False,
              **kwargs: Any) -> LedgerObservation:
        if fail:
            raise RuntimeError("this task cannot start")
        self.session, self.total, self.steps = uuid4().hex[:12], 0, 0
        LOG[self.session] = []
        return LedgerObservation(reply=f"session {self.session} (seed {seed}, extra {sorted(kwargs)})")

    def step(self, action: LedgerAction, timeout_s: float | None = None, **kwargs: Any) -> LedgerObservation:
        if action.text == "boom":
            raise ValueError("boom went the environment")
        if action.text == "sleep":
            time.sleep(1.0)
        self.steps += 1
        digits = sum(c.isdigit() for c in action.text)
        self.total += digits
        reward = digits / max(1, len(action.text))
        done = self.steps >= 3
        reply = f"{digits} digits, {self.total} in all"
        LOG[self.session].append((action.text, reward, done, reply))
        return LedgerObservation(reply=reply, total=self.total, reward=reward, done=done)

    @property
    def state(self) -> State:
        return State(episode_id=self.session, step_count=self.steps)


def run(coro: Any, timeout_s: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def session_of(messages: list[dict]) -> str:
    return re.search(r"session ([0-9a-f]{12})", " ".join(m["content"] for m in messages)).group(1)


@pytest.fixture(scope="module")
def server():
    srv, thread = start_in_thread(create_fastapi_app(Ledger, LedgerAction, LedgerObservation, max_concurrent_envs=64),
                                  websockets=True)
    yield srv
    srv.stop()
    assert not thread.is_alive()


# ------------------------------------------------------------------------------------------ the adapter
def test_an_episode_is_what_the_server_computed(server):
    async def play():
        env = OpenEnvEnvironment(server.url, action="text", observation="reply", system_prompt="Count.",
                                 reset_kwargs={"seed": 1, "mode": "x"})
        first = await env.reset({"prompt": "Write digits.", "seed": 7, "level": 2})
        results = [await env.step({"role": "assistant", "content": text}) for text in ("a1", "22", "x")]
        await env.close()
        return first, results

    first, results = run(play())
    session = session_of(first)
    assert first == [{"role": "system", "content": "Count."},  # the prompt and the reset observation: one message
                     {"role": "user", "content": f"Write digits.\n\nsession {session} (seed 7, extra ['level', "
                                                 "'mode'])"}]
    assert [(r.reward, r.done) for r in results] == [(0.5, False), (1.0, False), (0.0, True)]
    assert [(r.reward, r.done, r.observation[0]["content"]) for r in results] == [e[1:] for e in LOG[session]]
    assert [e[0] for e in LOG[session]] == ["a1", "22", "x"]


def test_json_observations_json_actions_and_functions(server):
    def shout(observation: dict) -> list[dict]:
        return [{"role": "user", "content": observation["reply"].upper()}]

    async def play():
        env = OpenEnvEnvironment(server.url, action="json", observation="json")
        first = await env.reset({"seed": 3})
        fenced = await env.step({"content": 'Sure:\n```json\n{"text": "1a2b"}\n```'})
        by_name = OpenEnvEnvironment(server.url, action="tokenmill.envs.openenv:parse_json_action", observation=shout)
        await by_name.reset({})
        bare = await by_name.step({"content": 'I say {"text": "777"} then'})
        await env.close(), await by_name.close()
        return first, fenced, bare

    first, fenced, bare = run(play())
    assert first[0]["content"].startswith('{"reply": "session ') and first[0]["content"].endswith(', "total": 0}')
    assert (fenced.reward, fenced.done) == (0.5, False)
    assert fenced.observation == [{"role": "user", "content": '{"reply": "2 digits, 2 in all", "total": 2}'}]
    assert (bare.reward, bare.observation) == (1.0, [{"role": "user", "content": "3 DIGITS, 3 IN ALL"}])


def test_a_reply_that_makes_no_action_ends_the_episode_with_reward_zero(server):
    def strict(text: str) -> dict:
        if not text.isdigit():
            raise ValueError(f"{text!r} is not a number")
        return {"text": text}

    async def play():
        out = []
        for action, reply in (("json", "no json here"), ("json", "[1, 2]"), ("json", '{"txt": "1"}'),
                              (strict, "abc"), ("text", "fine")):
            env = OpenEnvEnvironment(server.url, action=action, observation="reply")
            await env.reset({})
            out.append(await env.step({"content": reply}))
            await env.close()
        return out

    *invalid, valid = run(play())
    assert [(r.reward, r.done, r.observation) for r in invalid] == [(0.0, True, [])] * 4
    reasons = [r.info["invalid_action"] for r in invalid]
    assert reasons[0] == "no JSON object in the reply"
    assert reasons[1] == "no JSON object in the reply"  # a list has no '{'
    assert reasons[2].startswith("the server rejected the action: VALIDATION_ERROR: Invalid message: text: Field "
                                 "required; txt: Extra inputs are not permitted")
    assert reasons[3] == "'abc' is not a number"
    assert (valid.done, valid.info) == (False, {})


def test_a_server_that_is_down_errs_or_hangs_fails_the_episode_in_one_line(server):
    async def attempt(url: str, task: dict, text: str | None = None, timeout_s: float = 5.0,
                      observation: str = "json") -> str:
        env = OpenEnvEnvironment(url, action="text", observation=observation, timeout_s=timeout_s)
        try:
            await env.reset(task)
            await env.step({"content": text})
        except OpenEnvError as exc:
            return str(exc)
        finally:
            await env.close()
        raise AssertionError("no error")

    from tokenmill.serving import bind

    sock = bind("127.0.0.1", 0)  # a port nobody answers on
    down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    async def all_of_them():
        return await asyncio.gather(attempt(down, {}), attempt(server.url, {"fail": True}),
                                    attempt(server.url, {}, "boom"), attempt(server.url, {}, "sleep", timeout_s=0.3),
                                    attempt(server.url, {}, observation="score"))

    errors = run(all_of_them())
    assert all("\n" not in e for e in errors)
    assert errors[0].startswith(f"OpenEnv environment at {down}: reset failed: ConnectionError: Failed to connect")
    assert errors[1] == f"OpenEnv environment at {server.url}: reset failed: server error EXECUTION_ERROR: this task " \
                        "cannot start"
    assert errors[2] == f"OpenEnv environment at {server.url}: step failed: server error EXECUTION_ERROR: boom went " \
                        "the environment"
    assert errors[3] == f"OpenEnv environment at {server.url}: step failed: no answer within 0.3s"
    assert errors[4] == (f"OpenEnv environment at {server.url}: reset failed: LookupError: the observation has no "
                         "field 'score' (fields: reply, total); set env.openenv.observation")


def test_a_full_server_says_so(server):
    one, _ = start_in_thread(create_fastapi_app(Ledger, LedgerAction, LedgerObservation, max_concurrent_envs=1),
                             websockets=True)

    async def two_at_once():
        first, second = OpenEnvEnvironment(one.url), OpenEnvEnvironment(one.url)
        await first.reset({})
        try:
            await second.reset({})
        except OpenEnvError as exc:
            return str(exc)
        finally:
            await first.close(), await second.close()

    try:
        assert run(two_at_once()) == (f"OpenEnv environment at {one.url}: reset failed: the server is at capacity "
                                      "(1 sessions): set env.max_concurrent to at most its max_concurrent_envs")
    finally:
        one.stop()


# ------------------------------------------------------------------------------------------ the agent loop
def test_agent_loop_episodes_carry_the_servers_rewards_and_observations(server, tiny_model_path):
    """A tiny real model plays through the agent loop: every sample's return, turns and observations are the
    server's; a task whose reset fails fails its episodes alone (counted), and the others go on."""
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.envs.openenv import OpenEnvFactory
    from tokenmill.rollout.agent import AgentLimits, AgentLoop
    from tokenmill.types import SamplingParams

    engine = HFEngine.from_pretrained(tiny_model_path, seed=0)
    factory = OpenEnvFactory(server.url, action="text", observation="reply", system_prompt="Count.")
    loop = AgentLoop(engine, engine.tokenizer, factory, SamplingParams(max_tokens=6, n=3),
                     AgentLimits(max_turns=4, max_episode_tokens=512, end_on_truncation=False))
    tasks = [{"prompt": "Write digits.", "seed": s} for s in range(4)] + [{"prompt": "x", "fail": True}]
    groups, stats = loop.rollout(tasks)
    samples = [s for g in groups[:4] for s in g.samples]
    assert len(samples) == 12 and stats["agent/failed_episodes"] == 3
    for s in samples:
        steps = LOG[session_of(s.row["messages"])]
        assert s.reward == pytest.approx(sum(e[1] for e in steps)) and s.reward_errors == {}
        assert s.row["turns"] == len(steps) == 3 and steps[-1][2]  # the server's done ended every episode
        sent = [m["content"] for m in s.row["messages"] if m["role"] == "assistant"]
        assert sent == [e[0] for e in steps]
        said = [m["content"] for m in s.row["messages"][2:] if m["role"] == "user"]
        assert said == [e[3] for e in steps[:-1]]  # the last observation comes with done: the loop stops there
    for s in groups[4].samples:
        assert s.reward_errors["env"] == (f"reset failed: OpenEnvError: OpenEnv environment at {server.url}: reset "
                                          "failed: server error EXECUTION_ERROR: this task cannot start")


def test_served_guess_game_plays_like_the_built_in_one(tiny_model_path):
    """The example OpenEnv game, served by `env.openenv.serve`, against tokenmill's built-in guess_number:
    the same seeded engine and secrets give the same tokens, messages and rewards."""
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.envs.guess import GuessNumberEnv, guess_number_tasks
    from tokenmill.rollout.agent import AgentLimits, AgentLoop
    from tokenmill.types import SamplingParams

    tasks = [dict(r) for r in guess_number_tasks(6, seed=2)]  # prompt "1-7" (left out: the game says it), secret

    def rollout(factory, rows):
        engine = HFEngine.from_pretrained(tiny_model_path, seed=4)
        loop = AgentLoop(engine, engine.tokenizer, factory, SamplingParams(max_tokens=2, n=4),
                         AgentLimits(max_turns=3, end_on_truncation=False))
        return [s for g in loop.rollout(rows)[0] for s in g.samples]

    from tokenmill.config.openenv import OpenEnvConfig

    cfg = OpenEnvConfig(serve=GUESS, action="message", observation="message", system_prompt="guess",
                        task_prompt=False)
    factory = openenv_factory(cfg, {"max_turns": 3}, max_concurrent=64)
    try:
        assert factory.max_sessions == 64
        served = rollout(factory, tasks)
    finally:
        factory.close()
    local = rollout(GuessNumberEnv, tasks)
    assert len(served) == len(local) == 24
    for a, b in zip(local, served, strict=True):
        assert (a.tokens, a.loss_mask, a.reward, a.row["messages"]) == (b.tokens, b.loss_mask, b.reward,
                                                                         b.row["messages"])
    assert {s.row["turns"] for s in served} >= {3}
    with pytest.raises(OpenEnvError, match="ConnectionError"):  # close() stopped the server
        run(OpenEnvEnvironment(factory.url).reset({}))


# ------------------------------------------------------------------------------------------ serving, config
def test_serving_finds_the_action_and_observation_types_or_says_what_to_annotate():
    class Typed(Environment):  # no type arguments: typed through step's annotations only
        def reset(self, **kwargs: Any) -> LedgerObservation:
            return LedgerObservation()

        def step(self, action: LedgerAction, **kwargs: Any) -> LedgerObservation:
            return LedgerObservation()

        @property
        def state(self) -> State:
            return State()

    class Untyped(Typed):
        def step(self, action, **kwargs):
            return LedgerObservation()

    assert environment_types(Ledger) == (LedgerAction, LedgerObservation)
    assert environment_types(Typed) == (LedgerAction, LedgerObservation)
    with pytest.raises(ConfigError, match=r"^env.openenv.serve: cannot tell the Action and Observation classes of "
                                          r"Untyped: annotate step\(self, action: MyAction\) -> MyObservation"):
        environment_types(Untyped)


def test_serve_reports_bad_specs_and_constructors_as_config_errors():
    with pytest.raises(ConfigError, match=r"^env.openenv.serve: 'tokenmill.envs.openenv:INSTALL' is a str, not an "
                                          "OpenEnv Environment subclass or an OpenEnv FastAPI app$"):
        openenv_app("tokenmill.envs.openenv:INSTALL")
    with pytest.raises(ConfigError, match=r"^env.kwargs: cannot create GuessEnvironment: TypeError: .*'colour'"):
        openenv_app(GUESS, {"colour": "red"})
    app, sessions = openenv_app(GUESS.replace("GuessEnvironment", "app"))
    assert sessions is None and app.title == "OpenEnv Environment HTTP API"


def test_env_openenv_in_a_config_is_checked_with_its_field_named():
    from tokenmill.config import RLConfig, load_config

    base = {"model": {"path": "m"}, "data": {"task": "guess_number"}}

    def problem(env: dict) -> str:
        with pytest.raises(ConfigError) as info:
            load_config(RLConfig, {**base, "env": env})
        return str(info.value)

    assert "set exactly one of env.name, env.url, env.openenv or env.verifiers" in problem(
        {"name": "guess_number", "openenv": {"url": "http://127.0.0.1:1"}})
    assert "set exactly one of env.openenv.url (a running server) or env.openenv.serve" in problem(
        {"openenv": {"url": "http://127.0.0.1:1", "serve": GUESS}})
    assert "env.openenv.action" in problem({"openenv": {"url": "http://h:1", "action": "two words"}})
    assert "'two words' is neither a field name of the action, 'json', nor 'module:function'" in problem(
        {"openenv": {"url": "http://h:1", "action": "two words"}})
    assert "env.openenv.url" in problem({"openenv": {"url": "127.0.0.1:8000"}})
    cfg = load_config(RLConfig, {**base, "env": {"openenv": {"url": "ws://h:1", "action": "json",
                                                              "observation": "my.mod:render"}}})
    assert (cfg.env.openenv.url, cfg.env.openenv.action, cfg.env.name) == ("ws://h:1", "json", None)
    with pytest.raises(ConfigError, match=r"^env.kwargs: arguments for an environment's constructor; the server at "
                                          "env.openenv.url made its own"):
        openenv_factory(cfg.env.openenv, {"x": 1})
    with pytest.raises(ConfigError, match=r"^env.openenv.observation: cannot import module 'my.mod'"):
        openenv_factory(cfg.env.openenv)


def test_validate_reports_what_a_run_would_stumble_on(tmp_path, monkeypatch, capsys, tiny_model_path):
    from tokenmill.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "go", "seed": 1}\n')
    config = tmp_path / "run.yaml"
    for openenv, problem in (({"serve": "nowhere.py:Env"}, "env.openenv.serve: no such file 'nowhere.py'"),
                             ({"url": "http://h:1", "observation": "json:dumps"}, None),
                             ({"url": "http://h:1", "action": "tokenmill.envs.openenv:nothing"},
                              "env.openenv.action: module 'tokenmill.envs.openenv' has no attribute 'nothing'")):
        config.write_text(f"model: {{path: {tiny_model_path}}}\ndata: {{path: tasks.jsonl}}\n"
                          f"env: {{openenv: {json.dumps(openenv)}}}\n")
        code = main(["validate", str(config)])
        out = capsys.readouterr()
        assert code == (2 if problem else 0), out
        if problem:
            assert problem in out.err + out.out


def test_without_openenv_installed_the_error_names_the_extra(monkeypatch):
    from tokenmill.config.openenv import OpenEnvConfig

    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # how Python sees a missing package
    client_class.cache_clear()
    try:
        with pytest.raises(ConfigError) as info:
            openenv_factory(OpenEnvConfig(url="http://127.0.0.1:1"))
    finally:
        client_class.cache_clear()
    assert str(info.value) == "env.openenv: OpenEnv environments need openenv-core: pip install 'tokenmill[openenv]'"


def test_the_example_config_serves_the_example_game(monkeypatch):
    from tokenmill.config import RLConfig, load_config

    folder = Path(GUESS.rpartition(":")[0]).parent
    monkeypatch.chdir(folder)  # the config names env.py relative to its folder, as `tokenmill train` runs it
    cfg = load_config(RLConfig, "config.yaml")
    factory = openenv_factory(cfg.env.openenv, cfg.env.kwargs, timeout_s=cfg.env.step_timeout_s,
                              max_concurrent=cfg.env.max_concurrent)
    async def first_messages():
        env = factory()
        try:
            return await env.reset({"prompt": "1-7", "secret": 2, "high": 7})
        finally:
            await env.close()

    try:
        first = run(first_messages())
        assert first == [{"role": "system", "content": "guess"}, {"role": "user", "content": "1-7"}]
        assert factory.max_sessions == cfg.env.max_concurrent == 256
    finally:
        factory.close()
