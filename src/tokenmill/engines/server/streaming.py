"""`stream: true` for the engine server: OpenAI-style server-sent events, one chunk per sampled token.

    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "4"},
           "logprobs": {...} | null, "finish_reason": null, "token_ids": [19]}], ...}\\n\\n
    ...
    data: {... "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": [],
           "prompt_token_ids": [...], "policy_version": 0}], "policy_version": 0}\\n\\n
    data: [DONE]\\n\\n

Each chunk carries its token's id and (when asked for) logprob, so that a trainer behind a streaming agent
gets the same token truth as from a plain answer. Text is sent as soon as it cannot change any more: the
last `longest stop string - 1` characters wait (a stop string may still complete there and cut them), text
from a stop string on is never sent (the answer is cut there), and an incomplete UTF-8 character waits.
The streamed text therefore equals the plain answer's text.
The engine calls back from its own thread; the callback only hands the token over to the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engines.local.continuous import EngineUnavailable, RequestFuture
from tokenmill.engines.server import openai_wire as wire
from tokenmill.serving import ApiError
from tokenmill.types import Completion

DONE = b"data: [DONE]\n\n"


class TokenFeed:
    """The engine's per-token callback for one answer: (choice index, token, logprob) onto the loop's queue;
    a finished request puts ("done", prompt index)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def _put(self, item: tuple[Any, ...]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shut down): nobody listens any more
            pass

    def for_prompt(self, prompt_index: int, n: int) -> Callable[[int, int, float], None]:
        return lambda row, token, logprob: self._put((prompt_index * n + row, token, logprob))

    def watch(self, prompt_index: int, future: RequestFuture) -> None:
        future.add_done_callback(lambda _: self._put(("done", prompt_index)))


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the text of `tokens`, when decoded incrementally
    sent: str = ""  # text sent so far
    offset: int = 0  # completions' text_offset of the next token
    started: bool = False
    decoder: Any = None  # a `tokenizers` DecodeStream, when the tokenizer has one


def _incremental(tokenizer) -> Any:
    """A factory of `tokenizers.decoders.DecodeStream`s that decode exactly as `tokenizer.decode(ids,
    skip_special_tokens=True)` does, or None (then the reply is decoded whole at each token, O(n) per token)."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if getattr(tokenizer, "_tokenizer", None) is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None  # a slow tokenizer, or one whose decode rewrites spaces afterwards
    return lambda: DecodeStream(skip_special_tokens=True)


@dataclass
class StreamSpec:
    """What a stream needs to know about its request."""

    chat: bool
    model_name: str
    prompts: list[list[int]]
    n: int
    logprobs: bool
    tools: bool
    stops: tuple[str, ...]
    include_usage: bool


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class Streamer:
    """Turns the token events of one answer's requests into chunks."""

    def __init__(self, tokenizer, spec: StreamSpec) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        self.head = wire.envelope("chatcmpl" if spec.chat else "cmpl",
                                  "chat.completion.chunk" if spec.chat else "text_completion", spec.model_name)
        self.hold = max((len(s) for s in spec.stops), default=1) - 1
        make = _incremental(tokenizer)
        self.choices = [_Choice(decoder=make() if make else None) for _ in range(len(spec.prompts) * spec.n)]

    def _text(self, choice: _Choice, token: int) -> str:
        if choice.decoder is None:
            return self.tokenizer.decode(choice.tokens, skip_special_tokens=True)
        choice.text += choice.decoder.step(self.tokenizer._tokenizer, token) or ""  # None: a character is incomplete
        return choice.text

    def _chunk(self, index: int, text: str | None, token_ids: list[int], logprobs: list[float],
               finish: str | None = None, **more: Any) -> bytes:
        choice, tok = self.choices[index], self.tokenizer
        out: dict[str, Any] = {"index": index}
        if self.spec.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if not choice.started:
                delta = {"role": "assistant", **delta}
            out["delta"] = delta
            out["logprobs"] = wire.chat_logprobs(tok, token_ids, logprobs) if self.spec.logprobs and token_ids else None
        else:
            out["text"] = text or ""
            out["logprobs"] = (wire.text_logprobs(tok, token_ids, logprobs, choice.offset)
                               if self.spec.logprobs and token_ids else None)
            choice.offset += sum(len(p) for p in wire.pieces(tok, token_ids))
        choice.started = True
        return sse({**self.head, "choices": [out | {"finish_reason": finish, "token_ids": token_ids, **more}]})

    def token(self, index: int, token: int, logprob: float) -> bytes:
        choice = self.choices[index]
        choice.tokens.append(token)
        delta = None
        if not self.spec.tools:  # tool calls are parsed from the whole reply: its text comes at the end
            text = self._text(choice, token)
            # a stop string found now is the first: text before what was sent held none (the engine stops at one)
            start = max(0, len(choice.sent) - self.hold - 1)
            end = min([len(text) - self.hold] + [at for s in self.spec.stops if (at := text.find(s, start)) >= 0])
            safe = text[: max(0, end)].rstrip("\ufffd")
            if len(safe) > len(choice.sent) and safe.startswith(choice.sent):
                delta, choice.sent = safe[len(choice.sent):], safe
        return self._chunk(index, delta, [token], [logprob])

    def finish(self, index: int, c: Completion, prompt: list[int], version: int | None) -> bytes:
        """The choice's last chunk: the text still held back, the finish reason and the extras."""
        choice = self.choices[index]
        extra = {"prompt_token_ids": list(prompt), "policy_version": int(version or 0)}
        if self.spec.chat:
            message, reason = wire.chat_message(c, self.spec.tools)
            if "tool_calls" in message:
                calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                head = {"content": message["content"]} if message["content"] else {}
                payload = {**self.head, "choices": [{"index": index, "delta": {"role": "assistant", **head,
                           "tool_calls": calls}, "logprobs": None, "finish_reason": reason, "token_ids": [],
                           **extra}]}
                return sse(payload)
        else:
            reason = c.stop_reason.value
        rest = c.text[len(choice.sent):] if c.text.startswith(choice.sent) else ""
        return self._chunk(index, rest or None, [], [], reason, **extra)

    def usage(self, completion_tokens: int) -> bytes:
        return sse({**self.head, "choices": [], "usage": wire.usage(self.spec.prompts, completion_tokens)})


async def stream(streamer: Streamer, feed: TokenFeed, futures: list[RequestFuture], *, timeout_s: float,
                 cancel: Callable[[RequestFuture], None],
                 on_done: Callable[[list[RequestFuture]], None] | None = None) -> AsyncIterator[bytes]:
    """The chunks of one answer until `data: [DONE]`; `on_done(futures)` runs before it (proxy mode records
    the episode there). The requests are cancelled when the stream ends early (the client went away: the
    server cancels this generator) or runs past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left, generated = len(futures), 0
    n = streamer.spec.n
    try:
        while left:
            try:
                item = await asyncio.wait_for(feed.queue.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                yield _error(504, f"no answer within {timeout_s:g}s; the request was cancelled")
                return
            if item[0] != "done":
                generated += 1
                yield streamer.token(*item)
                continue
            left -= 1
            i = item[1]
            future = futures[i]
            try:
                completions = future.result()
            except EngineUnavailable as exc:
                yield _error(503, str(exc))
                return
            for j, c in enumerate(completions):
                yield streamer.finish(i * n + j, c, streamer.spec.prompts[i], future.policy_version)
        if on_done is not None:
            try:
                on_done(futures)
            except ApiError as exc:
                yield _error(exc.status, exc.message, exc.param)
                return
        if streamer.spec.include_usage:
            yield streamer.usage(generated)
        yield DONE
    finally:
        for f in futures:
            if not f.done():
                cancel(f)


def _error(status: int, message: str, param: str | None = None) -> bytes:
    """An error after the stream began (the status line is sent): one `data:` event in OpenAI's error shape."""
    kind = "timeout" if status == 504 else "server_error"
    if status < 500:
        kind = "invalid_request_error"
    return sse({"error": {"message": message, "type": kind, "param": param, "code": status}})
