"""JSON POSTs to every engine server at once, each bounded by a timeout, failures named by URL."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from tokenmill.sync.base import WeightSyncError


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
            raise WeightSyncError(f"{url}{path} refused (HTTP {response.status_code}): {detail}")
        return answer

    def submit(self, url: str, path: str, body: dict[str, Any]) -> Future:
        return self.pool.submit(self.post, url, path, body)

    def post_all(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        return collect([self.submit(u, path, body) for u in self.urls])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def collect(futures: list[Future]) -> list[dict[str, Any]]:
    """Wait for every call (each is bounded by the client timeout); raise one error naming every failure."""
    answers, errors = [], []
    for f in futures:
        try:
            answers.append(f.result())
        except WeightSyncError as e:
            errors.append(str(e))
    if errors:
        raise WeightSyncError("; ".join(errors))
    return answers
