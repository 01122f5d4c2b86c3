"""What the fuzz tests of tokenmill's HTTP servers (`tokenmill serve`, `env serve`, `serve-trainer`) ask of every
answer: a success, or a 4xx in the one error shape the servers share (`tokenmill.serving`)."""

from __future__ import annotations

from typing import Any


def check_error_shape(answer: Any) -> None:
    """`answer` (an `httpx.Response`) is a success, or a 4xx whose body is OpenAI's error object."""
    assert answer.status_code < 500, (answer.status_code, answer.text[:300])
    body = answer.json()
    if answer.status_code >= 400:
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
