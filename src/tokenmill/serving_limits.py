"""Connection limits under every tokenmill server: a read timeout and a cap on open connections.

uvicorn closes an idle kept-alive connection (`timeout_keep_alive`), but nothing else: a client that connects
and sends nothing, or sends its request a byte at a time (slowloris), holds a file handle for as long as it
likes, and a few thousand of them exhaust the process's handles (`RLIMIT_NOFILE`), after which the server
cannot accept anyone, nor open a checkpoint. `limited_protocol` wraps the HTTP protocol uvicorn would use
(httptools or h11) with:

* **A read timeout** (`read_timeout_s`, default 30 s). A request's head (request line and headers) must be
  complete within `read_timeout_s` of its first byte (of the connection, for the first request): a fixed
  deadline, which trickling bytes do not extend. Its body may pause at most `read_timeout_s` between chunks
  (a large upload that keeps arriving is not cut), and the clock stops while the server itself is not
  reading (the app has not taken the buffered body yet, or the client waits for `100 Continue`). Once the
  request is read, no timer runs: a streaming answer (server-sent events) or a slow generation may take
  as long as it takes. A connection whose head is late is answered 408 and closed; one whose body stalls
  is closed (the app sees a disconnect). Between requests, uvicorn's keep-alive timeout applies.
* **A cap on open connections** (`max_connections`, default half of the soft `RLIMIT_NOFILE`, at most 1000).
  A connection accepted at the cap makes room by closing the connection that has waited longest for a
  request's head (a slow or silent client), else the longest idle kept-alive one; when every connection
  is running a request, the newcomer is answered 503 and closed. So a flood of slow clients keeps the
  process's handles under the cap, and a client that sends its request at once (a probe's `GET /health`)
  is still served, at once, during the flood.

A connection is evicted or timed out by closing its transport, so its handle is released on the event
loop's next turn; a burst of connects is accepted before any of them is seen, so the count may pass the
cap by the size of one burst, for one turn. `tests/unit/test_serving_limits.py` measures both.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.types import TokenmillError

DEFAULT_READ_TIMEOUT_S = 30.0
MAX_DEFAULT_CONNECTIONS = 1000
_WARN_EVERY_S = 60.0
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"connection: close\r\ncontent-length: 29\r\n\r\nrequest not received in time\n")
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: 1\r\n"
         b"connection: close\r\ncontent-length: 30\r\n\r\ntoo many connections; retry\n\n")

log = logging.getLogger("tokenmill.serving")


class LimitsError(TokenmillError, ValueError):
    """A read timeout or connection cap that cannot work (zero, negative)."""


def default_max_connections() -> int:
    """Half the process's soft open-file limit (the other half for the model, checkpoints, pipes), between
    16 and `MAX_DEFAULT_CONNECTIONS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, soft // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    """read_timeout_s:  seconds a request (its head; its body between chunks) may take to arrive
    max_connections: open connections at most; None: `default_max_connections()`"""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int | None = None

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0:
            raise LimitsError(f"read_timeout_s: must be > 0 seconds (got {self.read_timeout_s})")
        if self.max_connections is not None and self.max_connections < 1:
            raise LimitsError(f"max_connections: must be at least 1 (got {self.max_connections})")

    @property
    def cap(self) -> int:
        return self.max_connections if self.max_connections is not None else default_max_connections()


class ConnectionSlots:
    """One server's open connections: which may be evicted (the oldest waiting for a head first, then the
    oldest idle), and counts of what the limits did (`timed_out`, `evicted`, `refused`)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.cap, self.read_timeout_s = limits.cap, limits.read_timeout_s
        self.live: set[Any] = set()
        self.reading: dict[Any, None] = {}  # insertion ordered: oldest first
        self.idle: dict[Any, None] = {}
        self.timed_out = self.evicted = self.refused = 0
        self._warned_at = -_WARN_EVERY_S

    def admit(self, conn: Any) -> bool:
        """Take `conn` (just connected), making room at the cap; False: refused (it is being closed)."""
        if len(self.live) >= self.cap:
            victim = next(iter(self.reading), None) or next(iter(self.idle), None)
            self._warn()
            if victim is None:
                self.refused += 1
                conn.transport.write(_FULL)
                conn.transport.close()
                return False
            self.evicted += 1
            victim.close_now()
        self.live.add(conn)
        return True

    def mark(self, conn: Any, state: str) -> None:
        """`conn` is now "reading" a head, "idle" between requests, or "busy" (not to be evicted)."""
        self.reading.pop(conn, None)
        self.idle.pop(conn, None)
        if state == "reading":
            self.reading[conn] = None
        elif state == "idle":
            self.idle[conn] = None

    def forget(self, conn: Any) -> None:
        self.live.discard(conn)
        self.mark(conn, "gone")

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("connection cap (%d) reached: closing the slowest or idlest connection for each new one "
                        "(evicted %d, refused %d, timed out %d so far)", self.cap, self.evicted, self.refused,
                        self.timed_out)


class _Limited:
    """Mixed in before uvicorn's HTTP protocol (see the module docstring). Uses the attributes both of its
    protocols have: `transport`, `loop`, `flow.read_paused`, `cycle` (`more_body`, `response_complete`,
    `waiting_for_100_continue`) and `on_response_complete`."""

    slots: ConnectionSlots

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._phase, self._timer, self._deadline, self._got_bytes = "head", None, 0.0, False
        if self.slots.admit(self):
            self._enter("head")

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)  # type: ignore[misc]
        self._settle(after_response=False)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._got_bytes = False
        self._settle(after_response=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.slots.forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def close_now(self) -> None:
        """Close this connection (evicted or timed out); its handle goes on the loop's next turn."""
        self._cancel()
        self.slots.forget(self)
        self.transport.close()

    # -------------------------------------------------------------------------------------- phases
    def _settle(self, *, after_response: bool) -> None:
        if self.transport.is_closing():
            self._cancel()
            self.slots.forget(self)
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a request is being served
            if cycle.more_body:
                self._enter("body")
                self._deadline = self.loop.time() + self.slots.read_timeout_s  # each chunk buys more time
            else:
                self._enter("busy")
        elif after_response:
            self._enter("idle")  # uvicorn's keep-alive timer closes it if nothing comes
        elif self._phase != "head":
            self._enter("head")  # the first bytes of the next request

    def _enter(self, phase: str) -> None:
        if phase == self._phase and self._timer is not None:
            return
        self._phase = phase
        self.slots.mark(self, {"head": "reading", "idle": "idle"}.get(phase, "busy"))
        self._cancel()
        if phase in ("head", "body"):
            self._deadline = self.loop.time() + self.slots.read_timeout_s
            self._timer = self.loop.call_at(self._deadline, self._expire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._phase not in ("head", "body") or self.transport.is_closing():
            return
        now = self.loop.time()
        cycle = self.cycle
        if self._phase == "body" and (self.flow.read_paused or getattr(cycle, "waiting_for_100_continue", False)):
            self._deadline = now + self.slots.read_timeout_s  # the server is not reading: not the client's fault
        if now < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._expire)
            return
        self.slots.timed_out += 1
        if self._phase == "head" and self._got_bytes:
            self.transport.write(_TIMED_OUT)
        self.close_now()


def limited_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol `base` that enforces `limits`; its `slots` (shared by the
    connections of one server) count what the limits did."""
    return type(f"Limited{base.__name__}", (_Limited, base), {"slots": ConnectionSlots(limits)})
