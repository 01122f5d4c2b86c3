"""An `Environment` that lives behind an environment server (`tokenmill.envs.server`), spoken to over HTTP.

`RemoteEnvironment(url)` is a drop-in environment for the agent loop: `remote_factory(url)` is the factory
to hand it. Its methods are coroutines (the loop awaits them directly, no thread per call), and it keeps one
HTTP client, so an episode's turns reuse one keep-alive connection.

Failure policy, chosen by what is safe to repeat:

* `reset` and `close` are retried on connection errors and timeouts (with exponential backoff): a repeated
  reset only opens another episode (a lost one is closed by the server's idle TTL), a repeated close is a
  no-op (404 counts as closed).
* `step` is never retried: the server may have applied the action before the connection died, and doing it
  twice would corrupt the episode. A step that fails in any way raises `RemoteEnvError`, which fails that one
  episode in the agent loop; the run goes on.
* `close` never raises for a server that is gone: the episode is over either way, and an exception from a
  `finally` would hide the error that ended it. It logs a warning instead.

The token travels in clear over `http://`: beyond loopback, put TLS in front (`https://` URLs work) or use
an SSH tunnel.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
from typing import Any

import httpx

from tokenmill.envs.base import EnvFactory, Message, StepResult
from tokenmill.types import TokenmillError

log = logging.getLogger("tokenmill.envs.remote")

# Shorter than the server's keep-alive (30 s): the client drops idle connections first (see server.py).
_KEEPALIVE_EXPIRY_S = 4.0
_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class RemoteEnvError(TokenmillError, OSError):
    """A remote environment failed this episode: the server's error, a timeout or a lost connection.

    url, episode_id: which server and episode (episode_id is None before a reset succeeded)
    status:          the HTTP status when the server answered (500: the environment raised, 504: it timed
                     out, 404: the episode is gone), None when it did not
    """

    def __init__(self, message: str, *, url: str = "", episode_id: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.episode_id = episode_id
        self.status = status


class RemoteEnvironment:
    """One episode at a time on the server at `url` (e.g. "http://127.0.0.1:8765").

    token:     bearer token, when the server was started with one
    timeout_s: per-request limit (connects give up after min(timeout_s, 10 s)); keep it above the server's
               step_timeout_s to get its 504 with a reason rather than a bare client timeout
    retries:   extra attempts for reset/close after a connection error or timeout; backoff_s doubles each time
    """

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0, retries: int = 2,
                 backoff_s: float = 0.2) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"remote environment url must be http(s)://host:port, got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"need timeout_s > 0, retries >= 0, backoff_s >= 0; got {timeout_s}, {retries}, "
                             f"{backoff_s}")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string (or None)")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.episode_id: str | None = None
        self._open = False  # the server holds our episode: close() must end it
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"RemoteEnvironment({self.url!r}, episode_id={self.episode_id!r})"

    # -------------------------------------------------------------------------------------- protocol
    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if self._open:  # an instance reused for another episode: end the previous one first
            await self._end_episode()
        self.episode_id = None
        data = await self._request("POST", "/episodes", {"task": task}, what="reset", retry=True)
        episode_id, observation = data.get("episode_id"), data.get("observation")
        if not isinstance(episode_id, str) or not _is_messages(observation):
            raise self._error("reset", f"malformed answer from the server: {_preview(data)}")
        self.episode_id, self._open = episode_id, True
        return observation

    async def step(self, message: Message) -> StepResult:
        if not self._open or self.episode_id is None:
            raise RuntimeError(f"{self!r}: step() before reset() or after the episode ended")
        try:
            data = await self._request("POST", f"/episodes/{self.episode_id}/step", {"message": message},
                                       what="step", retry=False)
        except RemoteEnvError as exc:
            if exc.status in (404, 500, 504):  # the server has already forgotten the episode
                self._open = False
            raise
        observation, reward, done, info = (data.get(k) for k in ("observation", "reward", "done", "info"))
        history = data.get("history")
        if (not _is_messages(observation, allow_empty=True) or isinstance(reward, bool)
                or not isinstance(reward, int | float) or not isinstance(done, bool) or not isinstance(info, dict)
                or (history is not None and not _is_messages(history, allow_empty=True))):
            raise self._error("step", f"malformed answer from the server: {_preview(data)}")
        if done:
            self._open = False  # the server closed it
        return StepResult(observation=observation, reward=float(reward), done=done, info=info, history=history)

    async def close(self) -> None:
        try:
            if self._open:
                await self._end_episode()
        finally:
            client, self._client = self._client, None
            if client is not None:
                await client.aclose()

    # -------------------------------------------------------------------------------------- internals
    async def _end_episode(self) -> None:
        try:
            await self._request("DELETE", f"/episodes/{self.episode_id}", None, what="close", retry=True,
                                gone_ok=True)
        except RemoteEnvError as exc:
            log.warning("%s (the server's idle TTL will close it)", exc)
        finally:
            self._open = False

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.AsyncClient(
                base_url=self.url,
                verify=_ssl_context(),
                headers=headers,
                timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 10.0)),
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=1,
                                    keepalive_expiry=_KEEPALIVE_EXPIRY_S),
            )
        return self._client

    async def _request(self, method: str, path: str, body: dict[str, Any] | None, *, what: str, retry: bool,
                       gone_ok: bool = False) -> dict[str, Any]:
        content = None
        if body is not None:
            try:
                content = json.dumps(body, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{self!r}: the {what} request is not JSON-serialisable: {exc}") from exc
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                response = await self._http().request(
                    method, path, content=content,
                    headers={"Content-Type": "application/json"} if content is not None else None,
                )
            except _RETRYABLE as exc:
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                    continue
                tries = f" (after {attempts} attempts)" if attempts > 1 else ""
                raise self._error(what, _transport_cause(exc, self.timeout_s) + tries) from exc
            except httpx.HTTPError as exc:  # not worth repeating (bad URL, proxy refusal, ...)
                raise self._error(what, _transport_cause(exc, self.timeout_s)) from exc
            if gone_ok and response.status_code == 404:
                return {}
            return self._decode(response, what)
        raise AssertionError("unreachable")

    def _decode(self, response: httpx.Response, what: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.is_error:
            reason = data.get("error") if isinstance(data, dict) else None
            if isinstance(reason, dict):  # OpenAI's shape, {"error": {"message": ...}}
                reason = reason.get("message")
            reason = reason if isinstance(reason, str) else _preview(response.text)
            raise self._error(what, f"HTTP {response.status_code}: {reason}", status=response.status_code)
        if not isinstance(data, dict):
            raise self._error(what, f"the server's answer is not a JSON object: {_preview(response.text)}",
                              status=response.status_code)
        return data

    def _error(self, what: str, cause: str, status: int | None = None) -> RemoteEnvError:
        episode = self.episode_id or "none yet"
        return RemoteEnvError(f"remote environment {self.url} (episode {episode}): {what} failed: {cause}",
                              url=self.url, episode_id=self.episode_id, status=status)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once: building it (loading the CA bundle) takes ~40 ms, and every
    episode gets its own client."""
    return httpx.create_ssl_context()


def _transport_cause(exc: httpx.HTTPError, timeout_s: float) -> str:
    name = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:g}s ({name})"
    return f"{name}: {exc}" if str(exc) else name


def _is_messages(value: Any, allow_empty: bool = False) -> bool:
    return (isinstance(value, list) and (allow_empty or bool(value))
            and all(isinstance(m, dict) for m in value))


def _preview(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def remote_factory(url: str, **kwargs: Any) -> EnvFactory:
    """A factory of `RemoteEnvironment(url, **kwargs)`, one per episode. The arguments are checked now,
    not at the first episode."""
    RemoteEnvironment(url, **kwargs)
    return functools.partial(RemoteEnvironment, url, **kwargs)
