"""Client-side load balancing over several inference servers: least-outstanding choice, retries, failover.

    >>> pool = EndpointPool(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])        # doctest: +SKIP
    >>> pool.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 4})["choices"]   # doctest: +SKIP

Why least-outstanding and not round-robin: requests differ in length by 10x or more, so an even count of
requests is an uneven load; counting the requests each server is working on follows the real load, and a
continuous-batching server takes every request it gets into its running batch anyway.

Failure policy. A request that fails on the wire (refused, reset, timed out) or with a 5xx is sent again to
another server, and the server that failed is marked down for `cooldown_s`; after that it gets traffic again
only once a `/health` probe answers. A 4xx is the caller's error and is raised at once, never retried. When
every server is down the pool waits (`backoff_s`, doubling) and probes, up to `retries` extra attempts, then
raises `EngineUnavailable` naming each server and its last error. Sampling requests are safe to repeat: a
repeated request only draws again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.engines.base import EngineUnavailable
from tokenmill.types import TokenmillError

log = logging.getLogger("tokenmill.engines.remote.pool")

_WIRE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class EngineRequestError(TokenmillError):
    """A server refused a request (4xx): the request itself is wrong, so it is not retried elsewhere."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Endpoint:
    """One server as the pool sees it."""

    url: str
    client: httpx.Client
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    last_error: str = ""
    retired: bool = False  # missed a weight push: never routed to again (a replacement takes its place)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def is_up(self, now: float) -> bool:
        return not self.retired and now >= self.down_until


class EndpointPool:
    """Several OpenAI-compatible servers behind one `post()`; thread-safe (callers post from many threads).

    token:      bearer token sent to every server (None: no Authorization header)
    timeout_s:  per-request limit; connects give up after min(timeout_s, 10 s)
    retries:    extra rounds after every server failed once (each round tries every live server)
    cooldown_s: how long a failed server is skipped before a health probe may bring it back
    """

    def __init__(self, urls: list[str], *, token: str | None = None, timeout_s: float = 300.0, retries: int = 3,
                 backoff_s: float = 0.5, cooldown_s: float = 5.0, max_connections: int = 256) -> None:
        if not urls:
            raise ValueError("EndpointPool needs at least one server url")
        for url in urls:
            parsed = httpx.URL(url)
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise ValueError(f"engine server url must be http(s)://host:port, got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or cooldown_s < 0:
            raise ValueError("need timeout_s > 0 and retries, backoff_s, cooldown_s >= 0")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client_args = {"headers": headers, "timeout": timeout, "limits": limits}
        self.endpoints = [Endpoint(u.rstrip("/"), httpx.Client(base_url=u.rstrip("/"), **self._client_args))
                          for u in urls]
        self.retries, self.backoff_s, self.cooldown_s = retries, backoff_s, cooldown_s
        self._lock = threading.Lock()
        self._turn = 0

    # ------------------------------------------------------------------------------------------ requests
    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to the least-busy live server; fail over on wire errors and 5xx (see module doc)."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            tried: set[str] = set()
            while (ep := self._pick(exclude=tried)) is not None:
                tried.add(ep.url)
                try:
                    return self._post_one(ep, path, body)
                except (EngineServerError, *_WIRE_ERRORS) as exc:
                    self._mark_down(ep, exc)
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
                self.probe()
        raise EngineUnavailable(
            f"no engine server answered POST {path} after {self.retries + 1} round(s): "
            + "; ".join(f"{e.url}: {e.last_error or 'down'}" for e in self.endpoints)
        )

    def post_all(self, path: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """POST the same body to every server (weight updates); raise naming the servers that failed."""
        results: dict[str, dict[str, Any]] = {}
        errors: list[str] = []
        for ep in self.endpoints:
            try:
                results[ep.url] = self._post_one(ep, path, body)
            except (EngineServerError, EngineRequestError, *_WIRE_ERRORS) as exc:
                errors.append(f"{ep.url}: {exc}")
        if errors:
            raise EngineUnavailable(f"POST {path} failed on {len(errors)} server(s): " + "; ".join(errors))
        return results

    def post_live(self, path: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """POST the same body to every live server once; one that fails is marked down and left out of the
        answer (the weight-sync probe: a dead server is failover's business, not a missed push)."""
        results: dict[str, dict[str, Any]] = {}
        now = time.monotonic()
        for ep in [e for e in self.endpoints if e.is_up(now)]:
            try:
                results[ep.url] = self._post_one(ep, path, body)
            except (EngineServerError, *_WIRE_ERRORS) as exc:
                self._mark_down(ep, exc)
        return results

    def _post_one(self, ep: Endpoint, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with ep.lock:
            ep.outstanding += 1
        try:
            response = ep.client.post(path, json=body)
        finally:
            with ep.lock:
                ep.outstanding -= 1
        if response.status_code >= 500:
            raise EngineServerError(f"HTTP {response.status_code}: {_error_text(response)}")
        if response.status_code >= 400:
            raise EngineRequestError(f"{ep.url}{path}: HTTP {response.status_code}: {_error_text(response)}",
                                     response.status_code)
        with ep.lock:
            ep.served += 1
            ep.failures = 0
        return response.json()

    # ----------------------------------------------------------------------------------------- liveness
    def _pick(self, exclude: set[str]) -> Endpoint | None:
        now = time.monotonic()
        live = [e for e in self.endpoints if e.url not in exclude and e.is_up(now)]
        if not live:
            return None
        with self._lock:
            self._turn += 1
            turn = self._turn
        # least outstanding first; ties go round-robin so an idle pool spreads its first requests
        return min(live, key=lambda e: (e.outstanding, (self.endpoints.index(e) - turn) % len(self.endpoints)))

    def _mark_down(self, ep: Endpoint, exc: BaseException) -> None:
        with ep.lock:
            ep.failures += 1
            ep.last_error = f"{type(exc).__name__}: {exc}"[:300]
            ep.down_until = time.monotonic() + self.cooldown_s
        log.warning("engine server %s failed (%s); sending its requests elsewhere", ep.url, ep.last_error)

    def retire(self, urls: set[str]) -> None:
        """Never route to these servers again: a weight sync dropped them, so they hold older weights, and a
        health probe must not bring them back. `replace` swaps one for a fresh server."""
        urls = {u.rstrip("/") for u in urls}
        for ep in self.endpoints:
            if ep.url in urls and not ep.retired:
                ep.retired, ep.last_error = True, "retired: missed a weight push (it holds older weights)"
                log.warning("engine server %s missed a weight push; no longer sent requests", ep.url)

    def probe(self) -> dict[str, bool]:
        """Ask every server for `/health`; a server that answers is live again at once (a retired one is not
        asked: it stays out)."""
        status = {}
        for ep in self.endpoints:
            if ep.retired:
                status[ep.url] = False
                continue
            try:
                ok = ep.client.get("/health", timeout=5.0).status_code == 200
            except _WIRE_ERRORS as exc:
                ok, ep.last_error = False, f"{type(exc).__name__}: {exc}"[:300]
            if ok:
                ep.down_until = 0.0
            status[ep.url] = ok
        return status

    def replace(self, old_url: str, new_url: str) -> None:
        """Swap a server for its replacement (a restarted replica): requests in flight to the old one finish or
        fail over as usual; new requests may go to the new one at once."""
        fresh = Endpoint(new_url.rstrip("/"), httpx.Client(base_url=new_url.rstrip("/"), **self._client_args))
        with self._lock:
            urls = [e.url for e in self.endpoints]
            if old_url.rstrip("/") not in urls:
                raise ValueError(f"{old_url} is not one of this pool's servers ({', '.join(urls)})")
            i = urls.index(old_url.rstrip("/"))
            # the old client is left open: a request still in flight on it fails over instead of raising
            self.endpoints = [*self.endpoints[:i], fresh, *self.endpoints[i + 1:]]

    def stats(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        return {e.url: {"served": e.served, "outstanding": e.outstanding, "up": e.is_up(now), "retired": e.retired,
                        "failures": e.failures, "last_error": e.last_error} for e in self.endpoints}

    def close(self) -> None:
        for ep in self.endpoints:
            ep.client.close()


class EngineServerError(TokenmillError):
    """A server answered 5xx: its fault, so the request may go to another server."""


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(body.get("detail", body) if isinstance(body, dict) else body)[:300]
