"""Chat conversations as tokens plus a loss mask that covers only what the model should learn to say.

The conversation is rendered once by the tokenizer's own chat template and tokenized once; which tokens are
trained is found by rendering growing prefixes of the conversation and marking the characters each trained
message adds (its content and the end-of-turn marker the template writes after it). Tokens are then
selected by their character offsets, so the ids are exactly those of the full rendering: no per-message
tokenization whose pieces would not concatenate to the real sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.types import TokenmillError

Message = dict[str, Any]


class ChatTemplateError(TokenmillError, ValueError):
    """The chat template cannot be used for masked training (e.g. it rewrites earlier turns)."""


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, tools) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt, tools=tools
    )


def trained_spans(
    tokenizer: Any, messages: Sequence[Message], train_roles: Sequence[str] = ("assistant",), tools=None,
    first: int = 0,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the messages whose role is in `train_roles`, from
    message `first` on (a prompt-completion conversation trains its completion only).

    An assistant span starts after the generation prompt (`<|assistant|>` and the like, which the model never
    writes; another role's span includes its header) and ends where the template's rendering of that message
    ends. Raises `ChatTemplateError` when a prefix of the conversation does not render as a prefix of the
    whole (templates that drop earlier reasoning do this).
    """
    full = _render(tokenizer, messages, False, tools)
    spans = []
    for i, message in enumerate(messages):
        if i < first or message.get("role") not in train_roles:
            continue
        # an assistant turn starts after the generation prompt; another role's header has no such prompt to
        # tell it apart, so it is trained too
        before = _render(tokenizer, messages[:i], message["role"] == "assistant", tools) if i else ""
        after = _render(tokenizer, messages[: i + 1], False, tools)
        if not (after.startswith(before) and full.startswith(after)):
            raise ChatTemplateError(
                f"message {i} ({message.get('role')}): the chat template does not render this conversation's "
                "prefixes as prefixes of the whole (it rewrites earlier turns), so the trained tokens cannot be "
                "located; train on single-turn rows or use a template without that rewriting"
            )
        spans.append((len(before), len(after)))
    return full, spans


def chat_tokens(
    tokenizer: Any, messages: Sequence[Message], train_roles: Sequence[str] = ("assistant",), tools=None,
    first: int = 0,
) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, loss mask: 1 on tokens that start inside a trained span of a
    message from `first` on)."""
    text, spans = trained_spans(tokenizer, messages, train_roles, tools, first)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    return ids, mask
