"""The proxy-mode routes: an OpenAI-compatible endpoint per episode, recording exact tokens for training.

    POST /proxy/{episode_id}/v1/chat/completions   chat messages in, one reply out (recorded)
    POST /proxy/{episode_id}/v1/completions        a text or token-id prompt in, one completion out (recorded)
    GET  /proxy/{episode_id}/v1/models             what the OpenAI SDK asks first, sometimes
    POST /v1/episodes/{episode_id}/reward          {"reward": 1.0, "group": "task-7"} ends the episode
    GET  /v1/episodes                              open / finished / dropped counts

The episode id lives in the URL so that an agent program only needs its `base_url` changed. One reply per
call (`n` = 1): an episode is one trajectory; GRPO's group is formed from several episodes that share a
`group` key. Mounted into the engine server by `create_app(..., extra_routers=[proxy_routes(...)])`, behind
the server's token and Host checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.rollout.generator import encode_prompt
from tokenmill.rollout.proxy import EpisodeError, EpisodeRecorder
from tokenmill.types import Completion, SamplingParams

_EPISODE = r"^[A-Za-z0-9_.:-]{1,128}$"


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI SDKs send fields we do not use (user, stream=False...)

    model: str = "policy"
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one reply per call: an episode is one trajectory")
    stop: str | list[str] | None = None
    stream: bool = Field(False, description="streaming is not offered in proxy mode")


class _Chat(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class _Text(_Sampling):
    prompt: str | list[int]


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float
    group: str | None = Field(None, max_length=256)


def proxy_routes(engine, tokenizer, recorder: EpisodeRecorder, *, max_tokens: int = 256,
                 timeout_s: float = 300.0) -> APIRouter:
    """Routes that sample from `engine` (an InferenceEngine; one with `submit` joins its running batch) and
    record every call into `recorder`. `max_tokens` is the default and the cap of a reply; a reply
    that takes over `timeout_s` is cancelled (504)."""
    router = APIRouter()
    # an engine without `submit` (a plain HFEngine) decodes one batch at a time: calls take turns
    turns = contextlib.nullcontext() if hasattr(engine, "submit") else threading.Lock()

    def generate(prompt_ids: list[int], params: SamplingParams) -> list[list[Completion]]:
        with turns:
            return engine.generate([prompt_ids], params)

    async def sample(prompt_ids: list[int], body: _Sampling) -> tuple[Completion, int]:
        if body.stream:
            raise HTTPException(400, "stream: streaming is not offered in proxy mode")
        wanted = body.max_completion_tokens or body.max_tokens or max_tokens
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        params = SamplingParams(max_tokens=min(wanted, max_tokens), temperature=max(body.temperature, 1e-5),
                                top_p=body.top_p, stop=stop, greedy=body.temperature == 0.0)
        if not hasattr(engine, "submit"):
            version = int(getattr(engine, "version", 0))
            [[completion]] = await run_in_threadpool(generate, prompt_ids, params)
            return completion, version
        try:  # a continuous-batching engine: the reply joins its running batch
            future = engine.submit(prompt_ids, params)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        try:
            [completion] = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            engine.cancel(future)
            raise HTTPException(504, f"no reply within {timeout_s:g} s") from None
        return completion, int(future.policy_version or 0)

    def record(episode_id: str, prompt_ids, completion, version, prompt) -> None:
        try:
            recorder.record(episode_id, prompt_ids, completion, version, prompt=prompt)
        except EpisodeError as exc:
            raise HTTPException(409, str(exc)) from None

    @router.post("/proxy/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, body: _Chat) -> dict[str, Any]:
        _check_id(episode_id)
        try:
            prompt_ids = _chat_ids(tokenizer, body.messages, body.tools)
        except Exception as exc:  # noqa: BLE001 - any template error is the caller's bad messages
            raise HTTPException(400, f"messages: the chat template could not render them: {exc}") from None
        completion, version = await sample(prompt_ids, body)
        record(episode_id, prompt_ids, completion, version, body.messages)
        message = {"role": "assistant", "content": completion.text}
        return _answer("chat.completion", body.model, prompt_ids, completion, version, {"message": message})

    @router.post("/proxy/{episode_id}/v1/completions")
    async def complete(episode_id: str, body: _Text) -> dict[str, Any]:
        _check_id(episode_id)
        prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else encode_prompt(tokenizer, body.prompt)
        completion, version = await sample(prompt_ids, body)
        record(episode_id, prompt_ids, completion, version, body.prompt)
        return _answer("text_completion", body.model, prompt_ids, completion, version, {"text": completion.text})

    @router.get("/proxy/{episode_id}/v1/models")
    async def models(episode_id: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "tokenmill"}]}

    @router.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, body: _Reward) -> dict[str, Any]:
        _check_id(episode_id)
        try:
            ep = recorder.finish(episode_id, body.reward, group=body.group)
        except EpisodeError as exc:
            raise HTTPException(404 if "not open" in str(exc) else 400, str(exc)) from None
        return {"episode_id": episode_id, "calls": ep.calls, "reward": ep.reward, "group": ep.group}

    @router.get("/v1/episodes")
    async def counts() -> dict[str, int]:
        return recorder.counts()

    return router


def _check_id(episode_id: str) -> None:
    if not re.match(_EPISODE, episode_id):
        raise HTTPException(400, "episode_id: 1-128 characters of A-Z a-z 0-9 _ . : -")


def _chat_ids(tokenizer, messages: list[dict[str, Any]], tools) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _answer(kind: str, model: str, prompt_ids: list[int], c: Completion, version: int,
            choice: dict[str, Any]) -> dict[str, Any]:
    finish = "length" if c.stop_reason.value == "length" else "stop"
    return {
        "id": f"tm-{uuid.uuid4().hex[:16]}", "object": kind, "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "finish_reason": finish, "token_ids": list(c.token_ids), **choice}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(c.token_ids),
                  "total_tokens": len(prompt_ids) + len(c.token_ids)},
        "prompt_token_ids": prompt_ids, "policy_version": version,
    }
