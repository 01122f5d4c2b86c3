"""Serve any `Environment` over HTTP, so that episodes can run in another process, container or machine.

Why HTTP + JSON and not pickle over a socket: an environment server is often written, deployed and upgraded
apart from the trainer (another venv, another language, a sandboxed box). JSON keeps the wire format
readable and safe: the server never unpickles what a client sends, and a client never runs what a server
returns. The protocol mirrors `Environment` one to one:

    GET    /health                  -> {"status": "ok", "episodes": n}
    POST   /episodes                {"task": {...}}     -> {"episode_id": id, "observation": [messages]}
    POST   /episodes/{id}/step      {"message": {...}}  -> {"observation", "reward", "done", "info"[, "history"]}
    DELETE /episodes/{id}           -> {"episode_id": id, "closed": true}

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}` (the one shape of
tokenmill's servers): 400 a bad body (`param` names the field; also a task lacking a field that reset() reads,
a KeyError naming a key the task does not have: `param` is `task.<key>`), 404 unknown episode, 409 a step already
running in that episode, 413 a body over `max_body_bytes`, 429 too many live episodes, 500 the environment
raised (the episode is closed and forgotten), 504 it ran past `step_timeout_s` (likewise), 401 bad or
missing token, 400 a `Host` header we do not serve (DNS rebinding: a web page must not be able to drive a
server on the user's loopback through a hostname it controls), 403 a state-changing request from another
`Origin`. The guard, binding and error shape are `tokenmill.serving`'s.

Plain (sync) environment methods run in their own daemon thread, not the loop's bounded default pool: a
step that hangs forever must neither take a pool slot from the other episodes for good nor keep the process
from exiting. Async methods run on the server's loop, so they must not block it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import math
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tokenmill import serving
from tokenmill.envs.base import EnvFactory, StepResult, as_messages, as_step_result
from tokenmill.serving import check_exposure, is_loopback
from tokenmill.serving_limits import ConnectionLimits
from tokenmill.types import ConfigError

__all__ = ["create_app", "load_factory", "serve"]

log = logging.getLogger("tokenmill.envs.server")
T = TypeVar("T")

_MAX_ERROR_CHARS = 4000


# ------------------------------------------------------------------------------------------ request bodies
class _ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: dict[str, Any]


class _StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: dict[str, Any]


# ------------------------------------------------------------------------------------------ helpers
async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh daemon thread; the awaiting side may be cancelled (timeout) and walk away."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # cancelled: the caller timed out and walked away
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            value, ok = context.run(fn, *args), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is gone (server shut down while this call hung): nobody waits
            pass

    threading.Thread(target=target, name="tokenmill-env", daemon=True).start()
    return await future


async def _invoke(fn: Callable[..., T | Awaitable[T]], *args: Any) -> T:
    """Like `tokenmill.envs.base.call`, but plain functions run in `_in_thread` (see the module docstring)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await _in_thread(fn, *args)
    if inspect.isawaitable(result):
        return await result
    return result  # type: ignore[return-value]


def _missing_field(exc: BaseException, task: dict[str, Any]) -> str | None:
    """The key a reset()'s KeyError names when the client's task does not have it (a bad request), else None."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str) and exc.args[0] not in task:
        return exc.args[0]
    return None


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _jsonable(value: Any, depth: int = 0) -> Any:
    """`value` made JSON-safe: containers recursively, arrays/tensors via `tolist()`, NaN/inf and anything
    else as text. Environments put all sorts of things into `info`; a numpy scalar must not cost a 500."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if depth < 64:
        if isinstance(value, dict):
            return {k if isinstance(k, str) else str(k): _jsonable(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [_jsonable(v, depth + 1) for v in value]
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            with contextlib.suppress(Exception):  # a broken tolist() falls back to text
                return _jsonable(tolist(), depth + 1)
    try:
        return str(value)
    except Exception:  # noqa: BLE001
        return f"<unprintable {type(value).__name__}>"


def _step_payload(result: StepResult) -> dict[str, Any]:
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"step() reward must be a finite number, got {reward!r}")
    payload = {
        "observation": _jsonable(result.observation),
        "reward": reward,
        "done": bool(result.done),
        "info": _jsonable(result.info),
    }
    if result.history is not None:  # a rewritten conversation (step-wise training); absent otherwise
        payload["history"] = _jsonable(result.history)
    return payload


def _error(status: int, message: str) -> JSONResponse:
    return serving.openai_error(status, message)


# ------------------------------------------------------------------------------------------ episodes
@dataclass(eq=False)
class _Episode:
    """One live environment. Mutable on purpose (unlike the value types): it is the server's per-episode
    bookkeeping, touched only from the event loop."""

    env: Any
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a step is running
    closing: bool = False  # DELETE arrived during that step: the step disposes of it when it ends


class _Episodes:
    """The live episodes of one app, and how they end (close with a bound, never raise)."""

    def __init__(self, close_timeout_s: float, ttl_s: float | None) -> None:
        self.live: dict[str, _Episode] = {}
        self.opening = 0  # episodes between factory() and reset()'s answer: they count against the limit
        self.close_timeout_s = close_timeout_s
        self.ttl_s = ttl_s
        self._background: set[asyncio.Task[None]] = set()

    async def dispose(self, env: Any, episode_id: str) -> None:
        if env is None or not hasattr(env, "close"):
            return
        try:
            await asyncio.wait_for(_invoke(env.close), self.close_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed close loses nothing of the episode
            log.warning("episode %s: close failed: %s", episode_id, _describe(exc))

    def dispose_later(self, env: Any, episode_id: str) -> None:
        """Close without making the client wait (the env just hung: its close may hang too)."""
        task = asyncio.get_running_loop().create_task(self.dispose(env, episode_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def reap(self) -> None:
        """Forget episodes idle longer than the TTL: clients that crashed or lost a reset's answer."""
        if self.ttl_s is None:
            return
        now = time.monotonic()
        for episode_id, ep in list(self.live.items()):
            if not ep.busy and now - ep.last_used > self.ttl_s:
                del self.live[episode_id]
                log.info("episode %s: idle for over %gs, closing it", episode_id, self.ttl_s)
                self.dispose_later(ep.env, episode_id)

    async def shutdown(self) -> None:
        episodes, self.live = self.live, {}
        await asyncio.gather(*(self.dispose(ep.env, i) for i, ep in episodes.items()))
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.close_timeout_s)


# ------------------------------------------------------------------------------------------ the app
def create_app(
    factory: EnvFactory,
    *,
    token: str | None = None,
    max_episodes: int = 1024,
    step_timeout_s: float = 60.0,
    allowed_hosts: Iterable[str] = (),
    episode_ttl_s: float | None = 3600.0,
    max_body_bytes: int = serving.DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An app serving fresh `factory()` environments, one per episode.

    token:          when set, every route but /health needs `Authorization: Bearer <token>`
    max_episodes:   live episodes at most (429 beyond): a runaway client cannot exhaust the host
    step_timeout_s: bound on factory()+reset(), on each step() and on close()
    allowed_hosts:  `Host` names served besides localhost/127.0.0.1/[::1] (any port); "*" disables the check
                    (only sensible behind a token, e.g. bound to 0.0.0.0)
    episode_ttl_s:  an episode idle this long is closed (checked when episodes are created); None: never
    max_body_bytes: larger request bodies are refused (413) before they are read
    """
    if max_episodes < 1 or step_timeout_s <= 0:
        raise ValueError(f"need max_episodes >= 1 and step_timeout_s > 0, got {max_episodes}, {step_timeout_s}")
    episodes = _Episodes(close_timeout_s=step_timeout_s, ttl_s=episode_ttl_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await episodes.shutdown()

    app = FastAPI(title="tokenmill environment server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.episodes = episodes
    serving.Guard.install(app, token=token, allowed_hosts=serving.host_set(allowed_hosts),
                          max_body_bytes=max_body_bytes)
    serving.install_openai_errors(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "episodes": len(episodes.live)}

    _episode_routes(app, episodes, factory, max_episodes, step_timeout_s)
    return app


def _episode_routes(app: FastAPI, episodes: _Episodes, factory: EnvFactory, max_episodes: int,
                    timeout_s: float) -> None:
    @app.post("/episodes")
    async def open_episode(body: _ResetBody) -> JSONResponse:
        return await _open(episodes, factory, body.task, max_episodes, timeout_s)

    @app.post("/episodes/{episode_id}/step")
    async def step(episode_id: str, body: _StepBody) -> JSONResponse:
        return await _step(episodes, episode_id, body.message, timeout_s)

    @app.delete("/episodes/{episode_id}")
    async def close_episode(episode_id: str) -> JSONResponse:
        ep = episodes.live.pop(episode_id, None)
        if ep is None:
            return _error(404, f"unknown episode {episode_id!r} (never opened, finished, failed or expired)")
        if ep.busy:
            ep.closing = True
        else:
            await episodes.dispose(ep.env, episode_id)
        return JSONResponse({"episode_id": episode_id, "closed": True})


async def _open(episodes: _Episodes, factory: EnvFactory, task: dict[str, Any], max_episodes: int,
                timeout_s: float) -> JSONResponse:
    """A new episode: factory() and reset(task) within the timeout; the environment's failure is the answer."""
    episodes.reap()
    if len(episodes.live) + episodes.opening >= max_episodes:
        return _error(429, f"too many live episodes (max_episodes={max_episodes}); close some first")
    episode_id = secrets.token_urlsafe(16)  # unguessable: without a token, ids are the only capability
    made: list[Any] = []

    async def open_() -> Any:
        made.append(await _invoke(factory))
        return as_messages(await _invoke(made[0].reset, task))

    episodes.opening += 1
    try:
        observation = _jsonable(await asyncio.wait_for(open_(), timeout_s))
    except asyncio.TimeoutError:
        episodes.dispose_later(made[0] if made else None, episode_id)
        return _error(504, f"reset timed out after {timeout_s:g}s")
    except Exception as exc:  # the environment's failure is the client's answer
        await episodes.dispose(made[0] if made else None, episode_id)
        missing = _missing_field(exc, task) if made else None  # made: the factory ran, reset raised
        if missing is not None:  # the client's mistake: a 400 naming the field, no traceback in the log
            log.info("episode %s: the task lacks %r", episode_id, missing)
            return serving.openai_error(400, f"task.{missing}: missing; this environment's reset() reads it (the "
                                        f"task has {sorted(task) or 'no fields'})", param=f"task.{missing}")
        log.warning("episode %s: reset failed: %s", episode_id, _describe(exc), exc_info=True)
        return _error(500, _describe(exc))
    finally:
        episodes.opening -= 1
    episodes.live[episode_id] = _Episode(made[0])
    return JSONResponse({"episode_id": episode_id, "observation": observation})


async def _step(episodes: _Episodes, episode_id: str, message: dict[str, Any], timeout_s: float) -> JSONResponse:
    """One step of a live episode; a failed or timed-out step ends (and closes) the episode."""
    ep = episodes.live.get(episode_id)
    if ep is None:
        return _error(404, f"unknown episode {episode_id!r} (never opened, finished, failed or expired)")
    if ep.busy:
        return _error(409, f"episode {episode_id!r} is already running a step")
    ep.busy = True
    try:
        payload = _step_payload(as_step_result(await asyncio.wait_for(_invoke(ep.env.step, message), timeout_s)))
    except asyncio.TimeoutError:
        episodes.live.pop(episode_id, None)
        episodes.dispose_later(ep.env, episode_id)
        log.warning("episode %s: step timed out after %gs", episode_id, timeout_s)
        return _error(504, f"step timed out after {timeout_s:g}s")
    except Exception as exc:
        episodes.live.pop(episode_id, None)
        log.warning("episode %s: step failed: %s", episode_id, _describe(exc), exc_info=True)
        await episodes.dispose(ep.env, episode_id)
        return _error(500, _describe(exc))
    finally:
        ep.busy, ep.last_used = False, time.monotonic()
    if ep.closing:
        await episodes.dispose(ep.env, episode_id)
        return _error(404, f"episode {episode_id!r} was closed during this step")
    if payload["done"]:
        episodes.live.pop(episode_id, None)
        await episodes.dispose(ep.env, episode_id)
    return JSONResponse(payload)


# ------------------------------------------------------------------------------------------ running it
def load_factory(spec: str, kwargs: dict[str, Any] | None = None) -> EnvFactory:
    """A built-in environment name or "package.module:Name" -> a factory (`partial(Name, **kwargs)` with
    kwargs); a bad spec raises ValueError."""
    from tokenmill.envs import resolve_env

    try:
        return resolve_env(spec, kwargs, field="environment spec")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def serve(
    spec: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    allow_remote: bool = False,
    kwargs: dict[str, Any] | None = None,
    *,
    max_episodes: int = 1024,
    step_timeout_s: float = 60.0,
    max_body_bytes: int = serving.DEFAULT_MAX_BODY_BYTES,
    limits: ConnectionLimits | None = None,
) -> None:
    """Serve the environment `spec` ("module:Class") until interrupted; once it accepts connections, print its
    `serving.ready_line` (port 0 binds a free port, named there). Loopback only, unless `allow_remote` and a
    token are both given (`--allow-remote`, `--token`). The current directory is importable, as with uvicorn.
    `limits`: read timeout and connection cap."""
    check_exposure(host, token, allow_remote)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory = load_factory(spec, kwargs)
    app = create_app(factory, token=token, max_episodes=max_episodes, step_timeout_s=step_timeout_s,
                     allowed_hosts=serving.bind_names(host), max_body_bytes=max_body_bytes)
    sock = serving.bind(host, port)
    url = serving.url_of(host, sock.getsockname()[1])
    scope = "loopback only" if is_loopback(host) else "reachable from the network"

    def ready() -> None:
        print(serving.ready_line(f"tokenmill env serve: {spec}", url, f"auth {'on' if token else 'off'}, {scope}"),
              flush=True)

    serving.serve_forever(app, sock, on_ready=ready, graceful_timeout_s=step_timeout_s, limits=limits)
