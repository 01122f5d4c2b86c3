"""The OpenAI wire format of the engine server: request bodies, their checks, prompts, and the answers'
pieces (choices, logprobs, stream chunks). No I/O here: `app.py` and `streaming.py` beside it call it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.engines.local.routing import encode_routed_experts
from tokenmill.engines.local.scoring import MAX_TOP_K
from tokenmill.serving import ApiError
from tokenmill.types import Completion, PromptLogprobs, SamplingParams

# torch seeds generators from a 64-bit value; beyond it `manual_seed` overflows
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def prompt_seed(seed: int | None, i: int) -> int | None:
    """The seed of a request's i-th prompt: `seed + i`, wrapped into the seedable range, so that equal
    prompts in one request do not draw equal samples."""
    if seed is None or i == 0:
        return seed
    return _SEED_MIN + (seed + i - _SEED_MIN) % (_SEED_MAX - _SEED_MIN + 1)


# ------------------------------------------------------------------------------------------ request bodies
class _Sampling(BaseModel):
    # OpenAI SDKs send fields we do not use (user, metadata, ...): ignored, but the ones that would change the
    # answer and that we cannot honour are refused by name in `refuse_unsupported`
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Any name is accepted; answers carry the served name.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31, description="0 or -1: off (vLLM's extra).")
    n: int = Field(1, ge=1, le=1024, description="Samples per prompt; they share one prefill.")
    stop: str | list[str] | None = Field(None, description="Stop strings (up to 16); the text is cut before.")
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX,
                             description="Per-request seed: the same seed gives the same tokens. With several "
                             "prompts, prompt i samples with seed + i (`prompt_seed`).")
    stream: bool = Field(False, description="Answer as server-sent events (chunks, then `data: [DONE]`).")
    stream_options: dict[str, Any] | None = Field(None, description="{'include_usage': true}: a last usage chunk.")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = Field(None, description="vLLM's flag; token ids are always returned.")
    return_routed_experts: bool = Field(False, description="tokenmill's extension for router replay: each choice "
                                        "carries `routed_experts`, vLLM's form (base64 `.npy`, [tokens read, "
                                        "layers, top_k]), from a server started with "
                                        "--enable-return-routed-experts.")


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate at most; 0 only scores the "
                                   "prompt (with prompt_logprobs).")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K, description="vLLM's extra: each prompt "
                                        "token's logprob (temperature 1) and this many most likely alternatives.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Return the sampled tokens' logprobs.")
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    images: list[dict[str, Any]] | None = Field(None, max_length=64, description="tokenmill's extension for a "
                                                "vision-language model: one token-id prompt's pictures, as "
                                                "`image_url` parts in the order of its image slots.")


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


def refuse_unsupported(body: _Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionBody):
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of is not supported (leave it unset or equal to n)", "best_of")
        if body.max_tokens == 0 and body.prompt_logprobs is None:
            raise ApiError(400, "max_tokens: 0 only scores the prompt; send prompt_logprobs with it", "max_tokens")
        if body.max_tokens == 0 and body.n != 1:
            raise ApiError(400, "n: scoring a prompt (max_tokens 0) answers one choice per prompt", "n")
        if body.prompt_logprobs is not None and body.stream:
            raise ApiError(400, "prompt_logprobs: not with stream", "prompt_logprobs")
    if body.return_routed_experts and body.stream:
        raise ApiError(400, "return_routed_experts: not with stream", "return_routed_experts")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError(400, "stop: up to 16 non-empty strings", "stop")


def sampling(body: _Sampling, max_tokens: int) -> SamplingParams:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    greedy = body.temperature == 0.0
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if greedy else body.temperature,
                          top_p=body.top_p, top_k=max(0, body.top_k), n=body.n, stop=stops, greedy=greedy)


# ------------------------------------------------------------------------------------------ prompts
def check_text(text: str, field: str) -> None:
    """Refuse text that cannot be encoded (a lone surrogate from a JSON "\\ud800" escape) with a 400 naming
    the field, before a tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{field}: not valid Unicode text ({exc.reason} at character {exc.start})",
                       field) from None


def completion_prompts(tokenizer, prompt: str | list) -> list[list[int]]:
    """Token ids of each prompt of a completions body (text is tokenised; ids are taken as they are)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            check_text(p, "prompt")
        ids = list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "prompt: a prompt encodes to no tokens", "prompt")
        out.append(ids)
    return out


def chat_text(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
              template_kwargs: dict[str, Any] | None = None) -> str:
    """OpenAI chat messages rendered by the tokenizer's chat template (generation prompt on), as text.
    Content given as a list of parts keeps its text parts."""
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages.{i}.role: a string is required", f"messages.{i}.role")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages.{i}.content: a string or a list of parts", f"messages.{i}.content")
        plain.append({**m, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages: the caller's input
        raise ApiError(400, f"messages: the chat template could not render them: {exc}"[:2000], "messages") from None
    if not isinstance(text, str):
        raise ApiError(400, "messages: the chat template did not render text", "messages")
    check_text(text, "messages")
    return text


def render_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt token ids of OpenAI chat messages under the tokenizer's chat template (generation prompt on)."""
    text = chat_text(tokenizer, messages, tools, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def longest_token_chars(tokenizer) -> int:
    """The most characters one vocabulary entry spells (byte-level vocabularies spell one character per
    byte, so no token decodes to more characters than its entry has)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


# ------------------------------------------------------------------------------------------ answers
def chat_message(c: Completion, tools: bool) -> tuple[dict[str, Any], str]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = c.stop_reason.value
    if tools:
        from tokenmill.tool_calls import HermesToolCallParser

        turn = HermesToolCallParser().parse(c.text)
        if turn.tool_calls:
            message = {"role": "assistant", "content": turn.content or None,
                       "tool_calls": [call.openai() for call in turn.tool_calls]}
            reason = "tool_calls" if reason == "stop" else reason
    return message, reason


def pieces(tokenizer, token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


def text_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float], at: int = 0) -> dict[str, Any]:
    """A completions choice's `logprobs`; `at`: the text offset of the first token."""
    parts = pieces(tokenizer, token_ids)
    offsets = []
    for piece in parts:
        offsets.append(at)
        at += len(piece)
    return {"tokens": parts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                        for piece, lp in zip(pieces(tokenizer, token_ids), logprobs, strict=True)]}


def prompt_logprobs(tokenizer, ids: Sequence[int], scored: PromptLogprobs, ranks: Sequence[int]) -> list[Any]:
    """A choice's `prompt_logprobs` as vLLM shapes it: None for the first token, then per token
    {"<id>": {"logprob", "rank", "decoded_token"}}: the token itself, then the asked-for alternatives."""
    out: list[Any] = [None]
    for i, t in enumerate(ids[1:]):
        entry = {str(t): {"logprob": scored.token_logprobs[i], "rank": ranks[i], "decoded_token": tokenizer.decode([t])}}
        tops = scored.top_logprobs[i] if scored.top_logprobs else {}
        for rank, (alt, lp) in enumerate(sorted(tops.items(), key=lambda kv: -kv[1]), start=1):
            entry.setdefault(str(alt), {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([alt])})
        out.append(entry)
    return out


def extras(prompt: list[int], c: Completion, version: int | None, route_layers: int = 0) -> dict[str, Any]:
    """The extension fields of a choice; with `route_layers` (a request for `return_routed_experts`) its
    `routed_experts` too, None where the engine recorded none for it."""
    out = {"token_ids": list(c.token_ids), "prompt_token_ids": list(prompt), "policy_version": int(version or 0)}
    if route_layers:
        out["routed_experts"] = None if c.routes is None else encode_routed_experts(c.routes, route_layers)
    return out


def usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(prefix: str, kind: str, model_name: str) -> dict[str, Any]:
    """The fields every answer (and every stream chunk of one answer) starts with."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name}


def answer(head: dict[str, Any], prompts: list[list[int]], versions: list[int | None],
           choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {**head, "choices": choices, "usage": usage(prompts, sum(len(c["token_ids"]) for c in choices)),
            "policy_version": min(int(v or 0) for v in versions)}
