"""JSON POSTs to every engine server at once, each bounded by a timeout, failures named by URL."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from tokenmill.sync.base import ServerUnreachable, WeightSyncError

log = logging.getLogger("tokenmill.sync")


class Refused(WeightSyncError):
    """The server answered that the input is wrong (HTTP 4xx): retrying or dropping servers cannot help."""


class Servers:
    """The engine servers a sync talks to. `submit` returns at once (the broadcast paths must send the control
    call and the tensors concurrently: a server's receive blocks until the trainer broadcasts)."""

    def __init__(self, urls: list[str], *, token: str | None = None, timeout_s: float = 300.0) -> None:
        if not urls:
            raise ValueError("urls: at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)))
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="weight-sync")

    def post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST and return the JSON answer; raise `WeightSyncError` naming `url + path` and the cause."""
        try:
            response = self.client.post(url + path, json=body)
        except httpx.TransportError as e:
            raise ServerUnreachable(f"{url}{path}: {type(e).__name__}: {e}", url) from e
        except httpx.HTTPError as e:
            raise WeightSyncError(f"{url}{path}: {type(e).__name__}: {e}") from e
        try:
            answer = response.json()
        except ValueError:
            answer = {"message": response.text[:500]}
        if not isinstance(answer, dict):
            answer = {"message": str(answer)[:500]}
        # ours and SGLang answer {"success": bool, "message"}; vLLM answers {"message"} with a status code
        if response.status_code >= 400 or answer.get("success") is False:
            detail = answer.get("message") or answer.get("detail") or answer.get("error") or response.text[:500]
            if response.status_code >= 500:  # the transfer failed (a peer died, a timeout): not the input
                raise WeightSyncError(f"{url}{path} failed (HTTP {response.status_code}): {detail}")
            raise Refused(f"{url}{path} refused (HTTP {response.status_code}): {detail}")
        return answer

    def submit(self, url: str, path: str, body: dict[str, Any]) -> Future:
        return self.pool.submit(self.post, url, path, body)

    def post_all(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        return collect([self.submit(u, path, body) for u in self.urls])

    def drop(self, urls: set[str]) -> None:
        """Forget servers that did not answer; raise when none is left."""
        log.warning("weight sync: dropping unreachable server(s) %s", sorted(urls))
        self.urls = [u for u in self.urls if u not in urls]
        if not self.urls:
            raise WeightSyncError(f"no engine server left: {sorted(urls)} unreachable")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class PushFailed(WeightSyncError):
    """Some calls failed: `unreachable` the URLs that did not answer at all, `refused` whether any server
    rejected the input (4xx), `only_unreachable` whether every failure was an unreachable server."""

    def __init__(self, message: str, unreachable: set[str], refused: bool, only_unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.refused = refused
        self.only_unreachable = only_unreachable


def collect(futures: list[Future]) -> list[dict[str, Any]]:
    """Wait for every call (each is bounded by the client timeout); raise one `PushFailed` naming every
    failure (`refused`: at least one server answered with a refusal, which dropping servers cannot fix)."""
    answers, errors, unreachable, refused = [], [], set(), False
    for f in futures:
        try:
            answers.append(f.result())
        except ServerUnreachable as e:
            errors.append(str(e))
            unreachable.add(e.url)
        except WeightSyncError as e:
            errors.append(str(e))
            refused = refused or isinstance(e, Refused)
    if errors:
        raise PushFailed("; ".join(errors), unreachable, refused, len(unreachable) == len(errors))
    return answers
