"""The one loopback HTTP layer under tokenmill's three servers (engine, environment, Composer).

What every server needs and gets from here, so that a fix lands in all three at once:

* `Guard`: ASGI middleware in front of routing and body parsing. In order: the `Host` header must name this
  server (DNS rebinding: a page on a hostname the attacker controls must not reach a loopback server), 400
  otherwise; a state-changing request that carries an `Origin` must come from this server's own origin
  (scheme, host and port compared), 403 otherwise; then the token (bearer header, or a cookie where the
  server sets one), 401 otherwise; and the body may not exceed `max_body_bytes` (413). A refused request
  costs nothing and learns nothing.
* `host_name`, `is_loopback`, `host_set`, `bind_names`: one parser and one notion of "loopback".
* `check_exposure`: a non-loopback bind needs an explicit flag and a token.
* `bind`: the socket, bound here so that port 0 works and a bind error is raised where it can be reported.
  Its proto is IPPROTO_TCP: asyncio turns Nagle off only on sockets whose proto says TCP, and with Nagle on
  every answer on a kept-alive connection waits ~40 ms for the client's delayed ACK [measured].
* `serve_forever` (a CLI server) and `start_in_thread` (tests, notebooks, proxy mode), both under
  `ConnectionLimits` (`tokenmill.serving_limits`): a read timeout for requests and a cap on open connections.
* `ready_line` / `read_port`: the line a server prints once it accepts connections, naming its bound port,
  so that a parent can start it with `--port 0` (no free-port race) and read the port back.
* OpenAI-shaped errors (`ApiError`, `openai_error`, `install_openai_errors`):
  `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from http.cookies import SimpleCookie
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from tokenmill.serving_limits import ConnectionLimits, ConnectionSlots, limited_protocol
from tokenmill.types import TokenmillError

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# Idle keep-alive connections live longer on the server than in our clients' pools (4 s), so that the
# client, not the server, is the side that drops an idle connection: no request races a closing socket.
KEEP_ALIVE_S = 30
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}

ErrorResponder = Callable[[int, str, "str | None"], Response]


class ExposureError(TokenmillError, ValueError):
    """A bind that would expose a server to the network without the user saying so (or without a token)."""


# ------------------------------------------------------------------------------------------ errors
class ApiError(TokenmillError):
    """An error answered in OpenAI's shape; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def field_of(message: str) -> str | None:
    """The field a message names by its leading "field: ..." (our convention), else None."""
    head = message.split(":", 1)[0]
    return head if head.replace(".", "_").isidentifier() else None


def install_openai_errors(app: FastAPI) -> None:
    """Every error of `app` in OpenAI's shape: ApiError, HTTP errors, invalid bodies (400, `param` = the first
    bad field) and, last, anything unexpected (500, never a plain-text traceback)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        return openai_error(exc.status_code, message, field_of(message))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors(), custom_encoder={bytes: lambda b: b.decode("utf-8", "replace")})

        def where(e: dict[str, Any]) -> str:
            return ".".join(str(p) for p in e.get("loc", ()) if p != "body")

        first = errors[0] if errors else {}
        summary = "; ".join(f"{where(e) or 'body'}: {e.get('msg', '')}" for e in errors[:5])
        return openai_error(400, f"invalid request: {summary}"[:2000], where(first) or None)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:  # the server logs the traceback
        return openai_error(500, f"internal error: {type(exc).__name__}")


# ------------------------------------------------------------------------------------------ hosts
def normalise_host(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]")


# a Host header: a name or IPv4 address, or a bracketed IPv6 address, then an optional port
_HOST = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9._-]+))(?::(\d{1,5}))?")


def _split_host(value: str) -> tuple[str, int | None] | None:
    """("name", port or None) of a `Host` header value; None if malformed."""
    found = _HOST.fullmatch(value.strip().lower())
    if found is None or (found.group(3) and int(found.group(3)) > 65535):
        return None
    return found.group(1) or found.group(2), int(found.group(3)) if found.group(3) else None


def host_name(value: str) -> str:
    """The host part of a `Host` header ("[::1]:80" -> "::1", "LocalHost:1" -> "localhost"); "" if malformed."""
    split = _split_host(value)
    return split[0] if split else ""


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1); hostnames other than localhost are
    not resolved: they count as remote, which errs on the safe side."""
    host = normalise_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_names(bind_host: str) -> tuple[str, ...]:
    """Extra `Host` names for a server bound to `bind_host`: a wildcard bind is reached under names we cannot
    know, so it accepts any ("*"; `check_exposure` made sure a token guards it)."""
    name = normalise_host(bind_host)
    return ("*",) if name in ("", "0.0.0.0", "::") else (name,)


def host_set(extra: Iterable[str] = ()) -> frozenset[str]:
    """The `Host` names a server answers to: the loopback names plus `extra` ("*": any)."""
    return LOOPBACK_HOSTS | {normalise_host(h) for h in extra}


def check_exposure(host: str, token: str | None, allow_remote: bool, *, flag: str = "--allow-remote",
                   token_flag: str = "--token") -> None:
    """Refuse a bind that would let the network drive the server: a non-loopback host needs `allow_remote`
    and a token (named in messages as `flag` and `token_flag`, the CLI's names by default)."""
    if token is not None and not token:
        raise ExposureError(f"{token_flag}: must not be empty")
    if is_loopback(host):
        return
    if not (allow_remote and token):
        raise ExposureError(f"refusing to serve on non-loopback host {host!r}: bind 127.0.0.1 (and tunnel, e.g. "
                            f"`ssh -L`), or pass {flag} together with {token_flag} (a server reachable from the "
                            "network without a token lets anyone on it use it)")


def same_origin(origin: str, host_header: str) -> bool:
    """Whether `Origin` is this server's own origin: http(s), the same host and the same port as the `Host`
    the request was sent to (a port left out is the scheme's default)."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return False
    target = _split_host(host_header)
    if parts.scheme not in ("http", "https") or not parts.hostname or target is None:
        return False
    default = 443 if parts.scheme == "https" else 80
    return parts.hostname == target[0] and (port or default) == (target[1] or default)


# ------------------------------------------------------------------------------------------ the guard
class _BodyTooLarge(StarletteHTTPException):
    """Raised from the guard's `receive` once a body passes the cap: an HTTP error (413), so that FastAPI's body
    reading lets it through to the app's handler, which answers in the app's own shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large (over {limit} bytes)")


class Guard:
    """Host, Origin, token and body-size checks in front of an app (see the module docstring).

    token:          None: no token needed; else `Authorization: Bearer <token>` (or the cookie)
    allowed_hosts:  `Host` names served (`host_set`); "*" turns the check off (only behind a token)
    open_paths:     paths served without the token (e.g. /health for liveness probes)
    cookie:         a cookie name that may carry the token; `GET /?token=<token>` sets it (a browser UI)
    error:          builds a refusal in the app's own error shape: (status, message, param) -> Response
    max_body_bytes: request bodies beyond this answer 413 (announced by Content-Length, or counted)
    """

    def __init__(self, app: ASGIApp, *, token: str | None, allowed_hosts: frozenset[str],
                 open_paths: Iterable[str] = ("/health",), cookie: str | None = None,
                 error: ErrorResponder = openai_error, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if token is not None and not token:
            raise ValueError("token must be a non-empty string (or None for no auth)")
        self.app, self.token, self.allowed_hosts = app, token.encode() if token else None, allowed_hosts
        self.open_paths, self.cookie, self.error = frozenset(open_paths), cookie, error
        self.max_body_bytes = max_body_bytes

    @classmethod
    def install(cls, app: FastAPI, **options: Any) -> None:
        """Put the guard in front of `app`. The options are checked now (a bad token raises ValueError here):
        the app builds its middleware only when it first serves."""
        cls(app, **options)
        app.add_middleware(cls, **options)

    def _token_ok(self, headers: dict[bytes, bytes]) -> bool:
        assert self.token is not None
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.token):
            return True
        if self.cookie is None:
            return False
        jar = SimpleCookie()
        try:
            jar.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # noqa: BLE001 - a malformed cookie header is just no token
            return False
        given = jar.get(self.cookie)
        return given is not None and hmac.compare_digest(given.value.encode(), self.token)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes], host: str) -> Response | None:
        if "*" not in self.allowed_hosts and host_name(host) not in self.allowed_hosts:
            return self.error(400, f"Host header not allowed: {host!r:.80} (DNS rebinding guard; use the URL "
                                   "the server printed)", "Host")
        method = scope["method"]
        if method not in SAFE_METHODS:
            origin = headers.get(b"origin", b"").decode("latin-1")
            if origin and not same_origin(origin, host):
                return self.error(403, f"cross-origin request refused: Origin {origin!r:.80} is not this "
                                       "server", "Origin")
            if headers.get(b"sec-fetch-site", b"") == b"cross-site":
                return self.error(403, "cross-origin request refused (Sec-Fetch-Site: cross-site)", "Origin")
        if self.token is None or scope["path"] in self.open_paths:
            return None
        if self.cookie is not None and method == "GET" and scope["path"] == "/":
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
            if given and hmac.compare_digest(given.encode(), self.token):
                response = RedirectResponse("/", status_code=303)
                response.set_cookie(self.cookie, given, httponly=True, samesite="strict", path="/")
                return response
        if not self._token_ok(headers):
            response = self.error(401, "missing or wrong token (Authorization: Bearer <token>)", None)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        hosts = []
        for k, v in scope["headers"]:
            headers.setdefault(k, v)
            if k == b"host":
                hosts.append(v.decode("latin-1"))
        refusal = self._refusal(scope, headers, hosts[0] if len(hosts) == 1 else "")
        if refusal is None:
            length = headers.get(b"content-length", b"0")
            if not length.isdigit() or int(length) > self.max_body_bytes:
                refusal = self._too_large()
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self._limited(scope, receive, send)

    def _too_large(self) -> Response:
        return self.error(413, _BodyTooLarge(self.max_body_bytes).detail, None)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, counting body bytes as they arrive (a chunked body announces no length)."""
        seen, started = 0, False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _BodyTooLarge:
            if not started:
                await self._too_large()(scope, receive, send)


# ------------------------------------------------------------------------------------------ sockets
def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: any free one; read it with `.getsockname()[1]`) and already
    listening, so a client that connects as soon as the URL is printed waits in the backlog until the server
    accepts, instead of being refused. Raises ExposureError naming the address when the bind fails."""
    name = normalise_host(host)
    sock = socket.socket(socket.AF_INET6 if ":" in name else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((name, port))
        sock.listen(2048)  # uvicorn's own backlog
    except OSError as exc:
        sock.close()
        raise ExposureError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


def url_of(host: str, port: int) -> str:
    name = normalise_host(host)
    if name in ("", "0.0.0.0", "::"):
        name = "127.0.0.1"
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


def ready_line(what: str, url: str, details: str = "") -> str:
    """The line a server prints once it accepts connections; `read_port` reads the port back from it."""
    return f"{what} ready on {url}" + (f" ({details})" if details else "")


_READY = re.compile(r" ready on https?://(?:\[[^\]]*\]|[^\s:/]+):(\d+)")


def read_port(line: str) -> int | None:
    """The port named in a `ready_line`, or None for any other line."""
    found = _READY.search(line)
    return int(found.group(1)) if found else None


def wait_for_port(proc: subprocess.Popen, *, timeout_s: float, log: BinaryIO | None = None) -> int:
    """The port a spawned server (started with `--port 0`, stdout a pipe) names in its `ready_line`. Every
    line of its output goes on to `log` (closed at the end), or is drained, so that the pipe never fills.
    Raises TimeoutError when no ready line comes in time, ChildProcessError when the process ends first."""
    found: queue.Queue[int | None] = queue.Queue()

    def pump() -> None:
        announced = False
        try:
            for line in iter(proc.stdout.readline, b""):
                if log is not None:
                    log.write(line)
                    log.flush()
                if not announced and (port := read_port(line.decode("utf-8", "replace"))) is not None:
                    announced = True
                    found.put(port)
        finally:
            found.put(None)
            if log is not None:
                log.close()

    threading.Thread(target=pump, name="tokenmill-server-output", daemon=True).start()
    try:
        port = found.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no ready line within {timeout_s:g}s") from None
    if port is None:
        raise ChildProcessError(f"exited with code {proc.wait()} before it was ready")
    return port


def _config(app: ASGIApp, graceful_timeout_s: float, limits: ConnectionLimits | None,
            http: type[asyncio.Protocol] | None = None, websockets: bool = False) -> uvicorn.Config:
    """uvicorn's settings for our servers: its HTTP protocol (`http`, default httptools where installed, else
    h11) under `limits` (default `ConnectionLimits()`), and no WebSocket upgrade unless `websockets` (no server
    of ours has a WebSocket route; an OpenEnv environment served for a run does)."""
    protocol = limited_protocol(http or AutoHTTPProtocol, limits or ConnectionLimits())
    return uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, http=protocol,
                          ws="auto" if websockets else "none",
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=graceful_timeout_s)


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
        return url_of(self.host, self.port)

    @property
    def slots(self) -> ConnectionSlots:
        """The open connections and what the limits did to them (`timed_out`, `evicted`, `refused`)."""
        return self.config.http_protocol_class.slots

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish (up to the graceful timeout), then end the app."""
        self.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                self.force_exit = True
                self.thread.join(timeout_s)


def start_in_thread(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, graceful_timeout_s: float = 1.0,
                    startup_timeout_s: float = 10.0,
                    limits: ConnectionLimits | None = None,
                    http: type[asyncio.Protocol] | None = None,
                    websockets: bool = False) -> tuple[BackgroundServer, threading.Thread]:
    """Run `app` in a daemon thread and return once it accepts connections. Port 0 picks a free port:
    read it from `server.port` (or `server.url`). `limits`: read timeout and connection cap (defaults);
    `http`: uvicorn's HTTP protocol class (default: httptools where installed, else h11); `websockets`:
    accept WebSocket upgrades (off by default)."""
    config = _config(app, graceful_timeout_s, limits, http, websockets)
    sock = bind(host, port)
    server = BackgroundServer(config, sock)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tokenmill-server", daemon=True)
    server.thread = thread
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError("the server failed to start (see the log)")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the server did not start within {startup_timeout_s:g}s")
        time.sleep(0.01)
    return server, thread


def serve_forever(app: ASGIApp, sock: socket.socket, *, on_ready: Callable[[], None] | None = None,
                  graceful_timeout_s: float = 5.0, limits: ConnectionLimits | None = None) -> None:
    """Serve `app` on the bound `sock` in this thread until interrupted; `on_ready()` runs (on a helper
    thread) once the server accepts connections, e.g. to print its `ready_line`. `limits`: read timeout and
    connection cap (defaults: `ConnectionLimits()`)."""
    server = uvicorn.Server(_config(app, graceful_timeout_s, limits))

    def announce() -> None:
        deadline = time.monotonic() + 60
        while not server.started and not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.02)
        if server.started and on_ready is not None:
            on_ready()

    threading.Thread(target=announce, name="tokenmill-serve-announce", daemon=True).start()
    server.run(sockets=[sock])
