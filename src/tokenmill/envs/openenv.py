"""OpenEnv environments (the HTTP/WebSocket environment standard of TRL and SkyRL) as tokenmill environments.

`OpenEnvEnvironment(url)` plays one episode in one session of an OpenEnv server, through OpenEnv's own client
(`openenv.core.GenericEnvClient`, a WebSocket to the server's /ws: the server keeps one environment instance
per connection, which multi-turn episodes need; its stateless POST /reset and /step make a fresh instance
per request). Text meets the environment's typed actions and observations at two mappings:

* action: the reply text goes into one field of the action (`"message"`), or the reply is the action as a
  JSON object (`"json"`), or a function turns the text into the action dict (`"module:function"`). A reply
  that does not make an action (bad JSON, a function's ValueError, a server that rejects it as not matching
  the action schema) ends the episode with reward 0 and `info["invalid_action"]` saying why: it is the
  policy's mistake, and the return says so.
* observation: one field's value becomes the next user message (`"message"`), or all the observation's
  fields as JSON (`"json"`), or a function's text or messages (`"module:function"`).

Rewards (None counts as 0) and `done` pass through as the server computed them. The first messages are
`system_prompt`, the task row's `prompt` (a string or messages; `task_prompt=False` leaves it out) and the
reset observation; the row's other columns go to the environment's `reset` as keyword arguments (OpenEnv
passes on those its reset declares, such as `seed`). A server that is down, errs or does not answer within
`timeout_s` raises `OpenEnvError` (one line naming the server): the agent loop fails that episode and the
run goes on.

`openenv_app("module:MyEnvironment")` builds the server of an OpenEnv `Environment` subclass with OpenEnv's
own app factory (or takes an OpenEnv FastAPI app as is); `openenv_factory(cfg.env.openenv)`, what a run's
`env: {openenv: ...}` builds, serves it on a free loopback port in this process when asked to (`serve`) and
stops it when closed or dropped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import typing
import weakref
from collections.abc import Callable
from typing import Any

from tokenmill.config.imports import resolve
from tokenmill.envs.base import Message, StepResult
from tokenmill.types import ConfigError, TokenmillError

log = logging.getLogger("tokenmill.envs.openenv")

INSTALL = "pip install 'tokenmill[openenv]'"
_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)
_NOT_RESET_ARGS = ("prompt", "messages")  # task columns that are the conversation, not the environment's
_HANGUP_WAIT_S = 5.0  # how long close() waits for the server to end the session and hang up


class OpenEnvError(TokenmillError, OSError):
    """An OpenEnv server failed this episode: unreachable, an error of its own, or no answer in time."""


class InvalidAction(TokenmillError, ValueError):
    """The policy's reply makes no action: what an action mapping raises (any ValueError counts the same)."""


class _ServerError(Exception):
    """An error message from the server: its code (e.g. VALIDATION_ERROR, EXECUTION_ERROR) and text."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.code = str(data.get("code", "UNKNOWN")).rpartition(".")[2]  # "WSErrorCode.X" or "X"
        self.data = data
        detail = data.get("message", "unknown error")
        errors = data.get("errors")
        if isinstance(errors, list) and errors:  # pydantic's: [{"loc": [...], "msg": ...}, ...]
            detail += ": " + "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors
                                       if isinstance(e, dict))
        super().__init__(f"{self.code}: {detail}")


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


@functools.cache
def client_class() -> type:
    """OpenEnv's dict client, keeping the server's error code and validation details (its own
    `_send_and_receive` folds them into a RuntimeError's text), and the reason of a server that hung up."""
    try:
        from openenv.core.generic_client import GenericEnvClient
        from websockets.exceptions import ConnectionClosed
    except ImportError:
        raise ConfigError(f"env.openenv: OpenEnv environments need openenv-core: {INSTALL}") from None

    class Client(GenericEnvClient):
        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            try:
                await self._send(message)
            except ConnectionClosed:  # a server at capacity says so and hangs up at once: read why below
                pass
            response = await self._receive()
            if response.get("type") == "error":
                raise _ServerError(response.get("data") or {})
            return response

        async def disconnect(self) -> None:
            """Ask the server to end the session and let it hang up first: its handler closes the socket
            itself, and logs a traceback when the client has already gone."""
            if self._ws is not None:
                try:
                    await self._ws.send(json.dumps({"type": "close"}))
                    await asyncio.wait_for(self._ws.wait_closed(), _HANGUP_WAIT_S)
                except Exception:  # noqa: BLE001, S110 - best effort: the socket is dropped below either way
                    pass
            await super().disconnect()

    return Client


# ------------------------------------------------------------------------------------------ mappings
def parse_json_action(text: str) -> dict[str, Any]:
    """The reply as a JSON object: the whole text, a ```json fenced block, or the span from the first '{' to
    the last '}'."""
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end < start:
        raise InvalidAction("no JSON object in the reply")
    try:
        action = json.loads(body[start : end + 1])
    except ValueError as exc:
        raise InvalidAction(f"the reply's JSON does not parse: {exc}") from None
    if not isinstance(action, dict):
        raise InvalidAction(f"the reply's JSON is a {type(action).__name__}, not an object")
    return action


def action_mapping(spec: str | Callable[[str], dict], field: str = "env.openenv.action") -> Callable[[str], dict]:
    """text -> action dict, from a field name, 'json', 'module:function' or a callable."""
    if callable(spec):
        return spec
    if spec == "json":
        return parse_json_action
    return _function(spec, field) if ":" in spec else functools.partial(_into_field, spec)


def _function(spec: str, field: str) -> Callable[..., Any]:
    fn = resolve(spec, field)
    if not callable(fn):
        raise ConfigError(f"{field}: {spec!r} names a {type(fn).__name__}, not a function")
    return fn


def _into_field(name: str, text: str) -> dict[str, Any]:
    return {name: text}


def observation_mapping(spec: str | Callable[[dict], Any],
                        field: str = "env.openenv.observation") -> Callable[[dict], Any]:
    """observation dict -> text or messages, from a field name, 'json', 'module:function' or a callable."""
    if callable(spec):
        return spec
    if spec == "json":
        return _as_json
    return _function(spec, field) if ":" in spec else functools.partial(_field_text, spec)


def _as_json(observation: dict[str, Any]) -> str:
    return json.dumps(observation, ensure_ascii=False)


def _field_text(name: str, observation: dict[str, Any]) -> str:
    if name not in observation:
        raise LookupError(f"the observation has no field {name!r} (fields: {', '.join(observation) or 'none'}); "
                       "set env.openenv.observation")
    value = observation[name]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _as_messages(value: Any, what: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if value else []
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return list(value)
    raise TypeError(f"{what} must give a string or a list of messages, got {type(value).__name__}")


def _prompt_messages(prompt: Any) -> list[Message]:
    if prompt is None:
        return []
    return _as_messages(prompt, "the task's prompt")


def _joined(messages: list[Message]) -> list[Message]:
    """Adjacent user messages (the task's prompt, then the reset observation) as one: chat templates that
    insist on alternating roles accept the result."""
    out: list[Message] = []
    for m in messages:
        if out and m["role"] == "user" == out[-1]["role"] and isinstance(out[-1].get("content"), str):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m.get('content', '')}"}
        else:
            out.append(dict(m))
    return out


# ------------------------------------------------------------------------------------------ environment
class OpenEnvEnvironment:
    """One episode in one session of the OpenEnv server at `url` (http(s):// or ws(s)://host:port).

    action, observation: the mappings (see the module docstring), as spec strings or callables
    system_prompt:       a system message opening the episode
    task_prompt:         the task row's prompt comes before the reset observation (False: the observation alone)
    reset_kwargs:        keyword arguments for every reset (the task's columns override them)
    timeout_s:           per message limit (connects give up after min(timeout_s, 10 s))
    """

    def __init__(self, url: str, *, action: str | Callable[[str], dict] = "message",
                 observation: str | Callable[[dict], Any] = "json", system_prompt: str | None = None,
                 task_prompt: bool = True, reset_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url.rstrip("/")
        self.to_action = action_mapping(action)
        self.to_text = observation_mapping(observation)
        self.system_prompt = system_prompt
        self.task_prompt = task_prompt
        self.reset_kwargs = dict(reset_kwargs or {})
        self.timeout_s = timeout_s
        self._client: Any = None

    def __repr__(self) -> str:
        return f"OpenEnvEnvironment({self.url!r})"

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        await self.close()  # an instance reused for another episode: end the previous session first
        self._client = client_class()(base_url=self.url, connect_timeout_s=min(self.timeout_s, 10.0),
                                      message_timeout_s=self.timeout_s)
        kwargs = {**self.reset_kwargs, **{k: v for k, v in task.items() if k not in _NOT_RESET_ARGS}}
        try:
            result = await self._client.reset(**kwargs)
            first = self._observation(result.observation)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line naming the server
            raise self._error("reset", exc) from None
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        prompt = _prompt_messages(task.get("prompt")) if self.task_prompt else []
        messages = _joined(system + prompt + first)
        if not messages:
            raise OpenEnvError(f"OpenEnv environment at {self.url}: reset gave nothing to say to the policy (an "
                               "empty observation, no prompt column, no env.openenv.system_prompt)")
        return messages

    async def step(self, message: Message) -> StepResult:
        if self._client is None:
            raise RuntimeError(f"{self!r}: step() before reset()")
        try:
            action = self.to_action(message.get("content") or "")
            if not isinstance(action, dict):
                raise InvalidAction(f"the action mapping gave a {type(action).__name__}, not a dict")
        except ValueError as exc:  # InvalidAction included
            return _invalid(str(exc))
        try:
            result = await self._client.step(action)
            observation = self._observation(result.observation)
        except _ServerError as exc:
            if exc.code == "VALIDATION_ERROR":  # the action does not fit the environment's action schema
                return _invalid(f"the server rejected the action: {exc}")
            raise self._error("step", exc) from None
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line naming the server
            raise self._error("step", exc) from None
        reward = 0.0 if result.reward is None else float(result.reward)
        return StepResult(observation, reward, bool(result.done), {})

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()  # sends "close" (best effort) and drops the connection
            except Exception as exc:  # noqa: BLE001 - the episode is over either way
                log.warning("OpenEnv environment at %s: close failed: %s", self.url, _one_line(exc))

    def _observation(self, observation: Any) -> list[Message]:
        if not isinstance(observation, dict):
            raise TypeError(f"the observation is a {type(observation).__name__}, not an object")
        return _as_messages(self.to_text(observation), "env.openenv.observation")

    def _error(self, what: str, exc: BaseException) -> OpenEnvError:
        return OpenEnvError(f"OpenEnv environment at {self.url}: {what} failed: {_cause(exc, self.timeout_s)}")


def _invalid(reason: str) -> StepResult:
    return StepResult([], 0.0, True, {"invalid_action": _one_line(reason)})


def _cause(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return f"no answer within {timeout_s:g}s"
    if isinstance(exc, _ServerError) and exc.code == "CAPACITY_REACHED":
        most = exc.data.get("max_sessions", "?")
        return (f"the server is at capacity ({most} sessions): set env.max_concurrent to at most its "
                "max_concurrent_envs")
    text = _one_line(exc)
    if isinstance(exc, _ServerError):
        return f"server error {text}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ------------------------------------------------------------------------------------------ serving
def environment_types(cls: type, field: str = "env.openenv.serve") -> tuple[type, type]:
    """The (Action, Observation) classes of an OpenEnv Environment subclass: from its generic base
    (`Environment[MyAction, MyObservation, State]`) or its step's annotations."""
    from openenv.core.env_server.types import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if (len(args) >= 2 and isinstance(args[0], type) and issubclass(args[0], Action)
                    and isinstance(args[1], type) and issubclass(args[1], Observation)):
                return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001 - unresolvable annotations: reported below
        hints = {}
    action, observation = hints.get("action"), hints.get("return")
    if (isinstance(action, type) and issubclass(action, Action) and isinstance(observation, type)
            and issubclass(observation, Observation)):
        return action, observation
    raise ConfigError(f"{field}: cannot tell the Action and Observation classes of {cls.__name__}: annotate "
                      "step(self, action: MyAction) -> MyObservation, or subclass Environment[MyAction, "
                      "MyObservation, State]")


def openenv_app(spec: str, kwargs: dict[str, Any] | None = None, max_sessions: int = 1,
                field: str = "env.openenv.serve") -> tuple[Any, int | None]:
    """(FastAPI app, sessions it holds at once, None if unknown) for an OpenEnv Environment subclass, built
    with OpenEnv's app factory (at most `max_sessions` sessions, 1 unless the class declares
    SUPPORTS_CONCURRENT_SESSIONS), or an OpenEnv app given as is."""
    client_class()  # the one-line install hint when OpenEnv is missing
    from openenv.core.env_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from starlette.applications import Starlette

    obj = resolve(spec, field)
    if isinstance(obj, Starlette):
        if kwargs:
            raise ConfigError(f"{field}: env.kwargs are for an Environment class; {spec!r} is a ready app")
        return obj, None
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise ConfigError(f"{field}: {spec!r} is a {type(obj).__name__}, not an OpenEnv Environment subclass or "
                          "an OpenEnv FastAPI app")
    action, observation = environment_types(obj, field)
    factory = functools.partial(obj, **kwargs) if kwargs else obj
    try:
        factory().close()  # a constructor that fails is a config problem, found now rather than per episode
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"env.kwargs: cannot create {obj.__name__}: {type(exc).__name__}: {_one_line(exc)}") from None
    sessions = max_sessions if getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    return create_fastapi_app(factory, action, observation, max_concurrent_envs=sessions), sessions


class OpenEnvFactory:
    """Makes an `OpenEnvEnvironment` per episode (the agent loop's env factory). When it serves the
    environment itself, it owns that loopback server: `close()` stops it, as does dropping the factory.

    max_sessions: how many episodes the server takes at once (the served class's limit), None if unknown
    """

    def __init__(self, url: str, *, server: Any = None, max_sessions: int | None = None, **env_kwargs: Any) -> None:
        OpenEnvEnvironment(url, **env_kwargs)  # check the arguments (and resolve the mappings) now
        self.url = url
        self.max_sessions = max_sessions
        self.env_kwargs = env_kwargs
        self.server = server
        self._stop = weakref.finalize(self, server.stop) if server is not None else None

    def __call__(self) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self.url, **self.env_kwargs)

    def close(self) -> None:
        if self._stop is not None:
            self._stop()


def config_problem(cfg: Any) -> str | None:
    """What `tokenmill validate` finds wrong with an `env.openenv` section before a run (None: nothing): a
    missing package, import strings (`serve`, function mappings) that do not resolve."""
    try:
        client_class()
        action_mapping(cfg.action)
        observation_mapping(cfg.observation)
        if cfg.serve is not None:
            resolve(cfg.serve, "env.openenv.serve")
    except ConfigError as exc:
        return str(exc)
    return None


def openenv_factory(cfg: Any, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 60.0,
                    max_concurrent: int = 256) -> OpenEnvFactory:
    """The factory for a config's `env.openenv` (an `OpenEnvConfig`); `kwargs` (env.kwargs) go to a served
    class's constructor, `max_concurrent` (env.max_concurrent) is how many sessions a served class may hold."""
    client_class()
    if cfg.url is not None and kwargs:
        raise ConfigError("env.kwargs: arguments for an environment's constructor; the server at env.openenv.url "
                          "made its own (use env.openenv.reset_kwargs for its reset)")
    mapping = {"action": action_mapping(cfg.action), "observation": observation_mapping(cfg.observation),
               "system_prompt": cfg.system_prompt, "task_prompt": cfg.task_prompt, "reset_kwargs": cfg.reset_kwargs,
               "timeout_s": timeout_s}
    if cfg.url is not None:
        return OpenEnvFactory(cfg.url, **mapping)
    from tokenmill.serving import start_in_thread

    app, sessions = openenv_app(cfg.serve, kwargs, max_sessions=max_concurrent)
    server, _ = start_in_thread(app, websockets=True)  # OpenEnv's sessions are WebSocket connections
    log.info("serving %s at %s (%s sessions at once)", cfg.serve, server.url, sessions or "?")
    return OpenEnvFactory(server.url, server=server, max_sessions=sessions, **mapping)
