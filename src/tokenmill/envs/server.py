"""Serve any `Environment` over HTTP, so that episodes can run in another process, container or machine.

Why HTTP + JSON and not pickle over a socket: an environment server is often written, deployed and upgraded
apart from the trainer (another venv, another language, a sandboxed box). JSON keeps the wire format
readable and safe: the server never unpickles what a client sends, and a client never runs what a server
returns. The protocol mirrors `Environment` one to one:

    GET    /health                  -> {"status": "ok", "episodes": n}
    POST   /episodes                {"task": {...}}     -> {"episode_id": id, "observation": [messages]}
    POST   /episodes/{id}/step      {"message": {...}}  -> {"observation", "reward", "done", "info"}
    DELETE /episodes/{id}           -> {"episode_id": id, "closed": true}

Every error is a JSON `{"error": "..."}`: 404 unknown episode, 409 a step already running in that episode,
429 too many live episodes, 500 the environment raised (the episode is closed and forgotten), 504 it ran past
`step_timeout_s` (likewise), 401 bad or missing token, 400 a `Host` header we do not serve (DNS rebinding:
a web page must not be able to drive a server on the user's loopback through a hostname it controls).

Plain (sync) environment methods run in their own daemon thread, not the loop's bounded default pool: a
step that hangs forever must neither take a pool slot from the other episodes for good nor keep the process
from exiting. Async methods run on the server's loop, so they must not block it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import inspect
import ipaddress
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.envs.base import EnvFactory, StepResult, as_messages, as_step_result
from tokenmill.types import ConfigError

log = logging.getLogger("tokenmill.envs.server")
T = TypeVar("T")

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_MAX_ERROR_CHARS = 4000
# Idle keep-alive connections live longer on the server than in our client's pool (4 s), so that the
# client, not the server, is the side that drops an idle connection: no request races a closing socket.
_KEEP_ALIVE_S = 30


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
    return {
        "observation": _jsonable(result.observation),
        "reward": reward,
        "done": bool(result.done),
        "info": _jsonable(result.info),
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _host_name(value: str) -> str:
    """The host part of a `Host` header ("[::1]:80" -> "::1", "LocalHost:1" -> "localhost"); "" if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :] if end > 0 else "?"
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return ""
        return value[1:end]
    if value.count(":") == 1:
        value, port = value.split(":")
        if not port.isdigit():
            return ""
    elif ":" in value:  # an unbracketed IPv6 address is not a valid Host header
        return ""
    return value


def _normalise_host(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]")


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1); hostnames other than localhost are
    not resolved: they count as remote, which errs on the safe side."""
    host = _normalise_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------ middleware
class _Guard:
    """Host check (all routes), then bearer token (all but /health). Plain ASGI: runs before any routing
    or body parsing, so a rejected request costs nothing and learns nothing (not even which ids exist)."""

    def __init__(self, app: ASGIApp, *, token: str | None, allowed_hosts: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token is not None else None
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if "*" not in self.allowed_hosts:
            name = _host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else ""
            if name not in self.allowed_hosts:
                await _error(400, "Host header not allowed")(scope, receive, send)
                return
        if self.expected is not None and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(401, "missing or wrong bearer token")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
) -> FastAPI:
    """An app serving fresh `factory()` environments, one per episode.

    token:         when set, every route but /health needs `Authorization: Bearer <token>`
    max_episodes:  live episodes at most (429 beyond): a runaway client cannot exhaust the host
    step_timeout_s: bound on factory()+reset(), on each step() and on close()
    allowed_hosts: `Host` names served besides localhost/127.0.0.1/[::1] (any port); "*" disables the check
                   (only sensible behind a token, e.g. bound to 0.0.0.0)
    episode_ttl_s: an episode idle this long is closed (checked when episodes are created); None: never
    """
    if token is not None and not token:
        raise ValueError("token must be a non-empty string (or None for no auth)")
    if max_episodes < 1 or step_timeout_s <= 0:
        raise ValueError(f"need max_episodes >= 1 and step_timeout_s > 0, got {max_episodes}, {step_timeout_s}")
    episodes = _Episodes(close_timeout_s=step_timeout_s, ttl_s=episode_ttl_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await episodes.shutdown()

    app = FastAPI(title="tokenmill environment server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.episodes = episodes
    hosts = LOOPBACK_HOSTS | {_normalise_host(h) for h in allowed_hosts}
    app.add_middleware(_Guard, token=token, allowed_hosts=frozenset(hosts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors())
        summary = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in errors)
        return JSONResponse({"error": f"invalid request: {summary}", "detail": errors}, status_code=422)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "episodes": len(episodes.live)}

    @app.post("/episodes")
    async def open_episode(body: _ResetBody) -> JSONResponse:
        episodes.reap()
        if len(episodes.live) + episodes.opening >= max_episodes:
            return _error(429, f"too many live episodes (max_episodes={max_episodes}); close some first")
        episode_id = secrets.token_urlsafe(16)  # unguessable: without a token, ids are the only capability
        made: list[Any] = []

        async def open_() -> Any:
            made.append(await _invoke(factory))
            return as_messages(await _invoke(made[0].reset, body.task))

        episodes.opening += 1
        try:
            observation = _jsonable(await asyncio.wait_for(open_(), step_timeout_s))
        except asyncio.TimeoutError:
            episodes.dispose_later(made[0] if made else None, episode_id)
            return _error(504, f"reset timed out after {step_timeout_s:g}s")
        except Exception as exc:  # the environment's failure is the client's answer
            log.warning("episode %s: reset failed: %s", episode_id, _describe(exc), exc_info=True)
            await episodes.dispose(made[0] if made else None, episode_id)
            return _error(500, _describe(exc))
        finally:
            episodes.opening -= 1
        episodes.live[episode_id] = _Episode(made[0])
        return JSONResponse({"episode_id": episode_id, "observation": observation})

    @app.post("/episodes/{episode_id}/step")
    async def step(episode_id: str, body: _StepBody) -> JSONResponse:
        ep = episodes.live.get(episode_id)
        if ep is None:
            return _error(404, f"unknown episode {episode_id!r} (never opened, finished, failed or expired)")
        if ep.busy:
            return _error(409, f"episode {episode_id!r} is already running a step")
        ep.busy = True
        try:
            payload = _step_payload(as_step_result(await asyncio.wait_for(_invoke(ep.env.step, body.message),
                                                                          step_timeout_s)))
        except asyncio.TimeoutError:
            episodes.live.pop(episode_id, None)
            episodes.dispose_later(ep.env, episode_id)
            log.warning("episode %s: step timed out after %gs", episode_id, step_timeout_s)
            return _error(504, f"step timed out after {step_timeout_s:g}s")
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

    return app


# ------------------------------------------------------------------------------------------ running it
def load_factory(spec: str, kwargs: dict[str, Any] | None = None) -> EnvFactory:
    """A built-in environment name or "package.module:Name" -> a factory (`partial(Name, **kwargs)` with
    kwargs); a bad spec raises ValueError."""
    from tokenmill.envs import resolve_env

    try:
        return resolve_env(spec, kwargs, field="environment spec")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def check_exposure(host: str, token: str | None, allow_remote: bool) -> None:
    """Refuse configurations that would let the network drive the environment (which may run code)."""
    if token is not None and not token:
        raise ValueError("token must be a non-empty string")
    if allow_remote and not token:
        raise ValueError("allow_remote=True needs a token: a server reachable from the network without one "
                         "lets anyone on it run episodes (pass token=..., e.g. from `secrets.token_urlsafe()`)")
    if not is_loopback(host) and not allow_remote:
        raise ValueError(f"refusing to serve on non-loopback host {host!r}: bind 127.0.0.1 (and tunnel, e.g. "
                         "`ssh -L`), or pass allow_remote=True together with a token")


def _bound_hosts(host: str) -> tuple[str, ...]:
    """Extra `Host` names to accept for a server bound to `host`: a wildcard bind is reached under names we
    cannot know, so it accepts any (check_exposure guarantees a token there)."""
    name = _normalise_host(host)
    if name in ("", "0.0.0.0", "::"):
        return ("*",)
    return (name,)


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
) -> None:
    """Serve the environment `spec` ("module:Class") until interrupted. Loopback only, unless
    `allow_remote=True` and a token are both given. The current directory is importable, as with uvicorn."""
    check_exposure(host, token, allow_remote)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory = load_factory(spec, kwargs)
    app = create_app(factory, token=token, max_episodes=max_episodes, step_timeout_s=step_timeout_s,
                     allowed_hosts=_bound_hosts(host))
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d (auth %s, %s)", spec, shown, port, "on" if token else "off",
             "loopback only" if is_loopback(host) else "reachable from the network")
    config = uvicorn.Config(app, host=host, port=port, access_log=False, timeout_keep_alive=_KEEP_ALIVE_S)
    uvicorn.Server(config).run()


class BackgroundServer(uvicorn.Server):
    """A uvicorn server on its own thread and loop (tests, benchmarks, notebooks); `stop()` ends it."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket) -> None:
        super().__init__(config)
        self.sock = sock
        self.host: str = sock.getsockname()[0]
        self.port: int = sock.getsockname()[1]
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish (up to the graceful timeout), then close the envs."""
        self.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                self.force_exit = True
                self.thread.join(timeout_s)


def start_in_thread(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    graceful_timeout_s: float = 1.0,
    startup_timeout_s: float = 10.0,
) -> tuple[BackgroundServer, threading.Thread]:
    """Run `app` in a daemon thread and return once it accepts connections. Port 0 picks a free port:
    read it from `server.port` (or `server.url`). The socket is bound here, so the port is known at once
    and a bind error is raised here, not lost in the thread."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto set: asyncio turns Nagle off
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_normalise_host(host), port))
    except OSError:
        sock.close()
        raise
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            timeout_keep_alive=_KEEP_ALIVE_S, timeout_graceful_shutdown=graceful_timeout_s)
    server = BackgroundServer(config, sock)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tokenmill-env-server",
                              daemon=True)
    server.thread = thread
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError("the environment server failed to start (see the log)")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the environment server did not start within {startup_timeout_s:g}s")
        time.sleep(0.01)
    return server, thread
