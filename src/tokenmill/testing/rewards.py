"""Dense rewards for tests on random-init models: the share of digits in a completion, so that even an
untrained model's samples differ in reward and get non-zero advantages."""

from __future__ import annotations

from typing import Any


def digit_share(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The share of digits of each plain-text completion."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def chat_digit_share(prompts: list[Any], completions: list[list[dict[str, Any]]], **_: Any) -> list[float]:
    """`digit_share` of chat completions (each a list of messages; the first one's content is scored)."""
    return digit_share(prompts, [c[0]["content"] for c in completions])
