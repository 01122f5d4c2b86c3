"""`tokenmill serve`: an OpenAI-compatible HTTP server over a continuously batched engine.

    GET  /health                -> {"status": "ok", "policy_version": int, "running_rows", "waiting_requests"}
    GET  /v1/models             -> {"object": "list", "data": [{"id": model_name, "object": "model", ...}]}
    POST /v1/completions        OpenAI body; `prompt` is text, token ids, or a list of either
    POST /v1/chat/completions   OpenAI body; rendered with the model tokenizer's chat template (and `tools`)
    + the weight routes (`tokenmill.engines.weight_routes`) and any `extra_routers` (e.g. proxy mode)

Extras on every choice: `token_ids` (the exact sampled ids), `prompt_token_ids`, `policy_version`; on the
answer: `policy_version`, the oldest of its choices' (all tokens of one choice come from one version: the
engine finishes running requests before it swaps weights, see `tokenmill.engines.continuous`). Logprobs are
of the sampled token under softmax(logits / temperature), the quantity a trainer recomputes; top
alternatives are not computed (`top_logprobs` is null / empty). `finish_reason` is "stop", "length",
"tool_calls" (chat with `tools`, Hermes `<tool_call>` blocks parsed) or "abort" (interrupted by a weight
update or cancelled). `temperature: 0` is greedy decoding (logprobs then of the temperature-1 distribution).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 a bad body (`param` names the
field), 401 a missing or wrong bearer token, 403 a foreign `Origin`, 400 a `Host` we do not serve (DNS
rebinding), 429 the engine's queue is full, 503 the engine is closed or crashed, 504 no answer in time.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engines.continuous import ContinuousEngine, EngineBusy, EngineUnavailable, RequestFuture
from tokenmill.engines.proxy_routes import check_episode_id, episode_routes
from tokenmill.envs.server import LOOPBACK_HOSTS, _host_name, _normalise_host
from tokenmill.rollout.proxy import EpisodeError, EpisodeRecorder
from tokenmill.types import Completion, SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ApiError(Exception):
    """An error answered in OpenAI's shape; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


# ------------------------------------------------------------------------------------------ request bodies
class _Sampling(BaseModel):
    # OpenAI SDKs send fields we do not use (user, metadata, ...): ignored, but the ones that would change the
    # answer and that we cannot honour are refused by name in `_refuse_unsupported`
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Any name is accepted; answers carry the served name.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: off (vLLM's extra).")
    n: int = Field(1, ge=1, le=1024, description="Samples per prompt; they share one prefill.")
    stop: str | list[str] | None = Field(None, description="Stop strings (up to 16); the text is cut before.")
    seed: int | None = Field(None, description="Per-request seed: the same seed gives the same tokens.")
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = Field(None, description="vLLM's flag; token ids are always returned.")


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20, description="Return the sampled tokens' logprobs.")
    echo: bool = False
    best_of: int | None = Field(None, ge=1)


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


def _refuse_unsupported(body: _Sampling) -> None:
    if body.stream:
        raise ApiError(400, "streaming is not supported: send stream=false", "stream")
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
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError(400, "stop: up to 16 non-empty strings", "stop")


def _sampling(body: _Sampling, max_tokens: int) -> SamplingParams:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    greedy = body.temperature == 0.0
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if greedy else body.temperature,
                          top_p=body.top_p, top_k=max(0, body.top_k), n=body.n, stop=stops, greedy=greedy)


# ------------------------------------------------------------------------------------------ middleware
class _Guard:
    """Host check (all routes), Origin check (state-changing requests), then the bearer token (all but
    /health). Plain ASGI: a rejected request is answered before routing or body parsing."""

    def __init__(self, app: ASGIApp, *, token: str | None, allowed_hosts: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token is not None else None
        self.allowed_hosts = allowed_hosts

    def _allowed(self, name: str | None) -> bool:
        return "*" in self.allowed_hosts or (name or "") in self.allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        hosts = [v for k, v in headers if k == b"host"]
        if not self._allowed(_host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else ""):
            await error_response(400, "Host header not allowed (DNS rebinding guard)", "Host")(scope, receive, send)
            return
        origin = next((v.decode("latin-1") for k, v in headers if k == b"origin"), None)
        if (origin is not None and scope["method"] not in _SAFE_METHODS
                and not self._allowed(_normalise_host(urlsplit(origin).hostname or ""))):
            await error_response(403, f"Origin {origin!r} not allowed", "Origin")(scope, receive, send)
            return
        if self.expected is not None and scope["path"] != "/health":
            given = next((v for k, v in headers if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong bearer token (Authorization: Bearer ...)")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------ the app
def create_app(engine, *, model_name: str, token: str | None = None, extra_routers: Iterable[APIRouter] = (),
               allowed_hosts: Iterable[str] = (), request_timeout_s: float = 600.0,
               default_max_tokens: int = 1024, max_tokens_cap: int | None = None,
               recorder: EpisodeRecorder | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine` (a ContinuousEngine, or anything with `submit`, `cancel`,
    `tokenizer`, `version`).

    token:              when set, every route but /health needs `Authorization: Bearer <token>`
    allowed_hosts:      `Host` names served besides localhost / 127.0.0.1 / [::1]; "*" turns the check off
                        (only behind a token, e.g. bound to 0.0.0.0)
    request_timeout_s:  a request without an answer by then is cancelled (504)
    default_max_tokens: a chat request's `max_tokens` when it sends none (capped by the context left)
    max_tokens_cap:     the most tokens any request may generate (None: the context left)
    recorder:           proxy mode (`tokenmill.rollout.proxy`): the same two routes are also served under
                        `/proxy/<episode id>/v1/...`, one reply per call, each recorded into the episode;
                        `/v1/episodes/<id>/reward` ends an episode (see `engines/proxy_routes.py`)
    """
    if token is not None and not token:
        raise ValueError("token must be a non-empty string (or None for no auth)")
    app = FastAPI(title="tokenmill engine server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    hosts = LOOPBACK_HOSTS | {_normalise_host(h) for h in allowed_hosts}
    app.add_middleware(_Guard, token=token, allowed_hosts=frozenset(hosts))
    tokenizer = engine.tokenizer

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        head = message.split(":", 1)[0]
        return error_response(exc.status_code, message, head if head.isidentifier() else None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = jsonable_encoder(exc.errors())
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        summary = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                            f"{e.get('msg', '')}" for e in errors[:5])
        return error_response(400, f"invalid request: {summary}", param)

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = engine.stats() if hasattr(engine, "stats") else {}
        error = getattr(engine, "_error", None)
        if error is not None or getattr(engine, "_closed", False):
            return JSONResponse({"status": "error", "policy_version": int(engine.version),
                                 "message": f"engine unavailable: {error or 'closed'}"}, status_code=503)
        return JSONResponse({"status": "ok", "policy_version": int(engine.version),
                             "running_rows": stats.get("running_rows", 0),
                             "waiting_requests": stats.get("waiting_requests", 0)})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tokenmill"}]}

    async def run(prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[RequestFuture]:
        futures: list[RequestFuture] = []
        try:
            for prompt in prompts:
                futures.append(engine.submit(prompt, params, seed=seed))
            await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), request_timeout_s)
        except ValueError as exc:  # the engine names the field ("prompt: ...", "n: ...")
            head = str(exc).split(":", 1)[0]
            raise ApiError(400, str(exc), head if head.isidentifier() else None) from None
        except EngineBusy as exc:
            raise ApiError(429, str(exc)) from None
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc)) from None
        except TimeoutError:
            raise ApiError(504, f"no answer within {request_timeout_s:g}s; the request was cancelled") from None
        finally:
            for f in futures:
                if not f.done():
                    engine.cancel(f)
        return futures

    def room(prompts: list[list[int]]) -> int:
        """Tokens left in the model's context after the longest prompt (the engine refuses a full one)."""
        limit = getattr(engine, "max_positions", None)
        left = max(1, limit - max(len(p) for p in prompts)) if limit else 1 << 30
        return min(left, max_tokens_cap) if max_tokens_cap else left

    def record(episode_id: str | None, prompt: list[int], future: RequestFuture, shown: Any) -> None:
        """Proxy mode: the call's exact tokens go into its episode (an episode is one trajectory: n = 1)."""
        if episode_id is None:
            return
        [c] = future.result()
        try:
            recorder.record(episode_id, prompt, c, int(future.policy_version or 0), prompt=shown)
        except EpisodeError as exc:
            raise ApiError(409, str(exc)) from None

    def check_episode(episode_id: str | None, n: int) -> None:
        if episode_id is None:
            return
        check_episode_id(episode_id)
        if n != 1:
            raise ApiError(400, "n: one reply per call in proxy mode (an episode is one trajectory)", "n")

    async def complete_text(body: CompletionBody, episode_id: str | None) -> dict[str, Any]:
        check_episode(episode_id, body.n)
        _refuse_unsupported(body)
        prompts = _completion_prompts(tokenizer, body.prompt)
        if episode_id is not None and len(prompts) != 1:
            raise ApiError(400, "prompt: one prompt per call in proxy mode", "prompt")
        params = _sampling(body, min(body.max_tokens or 16, room(prompts)))
        futures = await run(prompts, params, body.seed)
        choices = []
        for i, (prompt, future) in enumerate(zip(prompts, futures, strict=True)):
            for j, c in enumerate(future.result()):
                choice = {"index": i * body.n + j, "text": c.text, "finish_reason": c.stop_reason.value,
                          "logprobs": None if body.logprobs is None else _text_logprobs(tokenizer, c)}
                choices.append(choice | _extras(prompt, c, future))
        record(episode_id, prompts[0], futures[0], body.prompt)
        return _answer("cmpl", "text_completion", model_name, prompts, futures, choices)

    async def complete_chat(body: ChatBody, episode_id: str | None) -> dict[str, Any]:
        check_episode(episode_id, body.n)
        _refuse_unsupported(body)
        prompt = render_chat(tokenizer, body.messages, body.tools, body.chat_template_kwargs)
        wanted = body.max_completion_tokens or body.max_tokens or default_max_tokens
        params = _sampling(body, min(wanted, room([prompt])))
        [future] = await run([prompt], params, body.seed)
        choices = []
        for j, c in enumerate(future.result()):
            message, reason = _chat_message(c, bool(body.tools))
            choice = {"index": j, "message": message, "finish_reason": reason,
                      "logprobs": _chat_logprobs(tokenizer, c) if body.logprobs else None}
            choices.append(choice | _extras(prompt, c, future))
        record(episode_id, prompt, future, body.messages)
        return _answer("chatcmpl", "chat.completion", model_name, [prompt], [future], choices)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> dict[str, Any]:
        return await complete_text(body, None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> dict[str, Any]:
        return await complete_chat(body, None)

    if recorder is not None:  # proxy mode: the same answers, each call recorded into its episode
        @app.post("/proxy/{episode_id}/v1/completions")
        async def proxy_completions(episode_id: str, body: CompletionBody) -> dict[str, Any]:
            return await complete_text(body, episode_id)

        @app.post("/proxy/{episode_id}/v1/chat/completions")
        async def proxy_chat_completions(episode_id: str, body: ChatBody) -> dict[str, Any]:
            return await complete_chat(body, episode_id)

        app.get("/proxy/{episode_id}/v1/models")(models)
        app.include_router(episode_routes(recorder))
    weight_routes = _weight_routes(engine)
    if weight_routes is not None:
        app.include_router(weight_routes)
    for router in extra_routers:
        app.include_router(router)
    return app


def _weight_routes(engine) -> APIRouter | None:
    """The "sync" side's routes, when that module is there (imported late: it pulls in torch.distributed)."""
    try:
        from tokenmill.engines.weight_routes import weight_routes
    except ModuleNotFoundError as exc:
        if exc.name != "tokenmill.engines.weight_routes":
            raise
        return None
    return weight_routes(engine)


# ------------------------------------------------------------------------------------------ wire helpers
def _completion_prompts(tokenizer, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", "prompt")
    out = []
    for p in prompt:
        ids = list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "prompt: a prompt encodes to no tokens", "prompt")
        out.append(ids)
    return out


def render_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt token ids of OpenAI chat messages under the tokenizer's chat template (generation prompt on).
    Content given as a list of parts keeps its text parts."""
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages.{i}.role: a string is required", f"messages.{i}.role")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages.{i}.content: a string or a list of parts", f"messages.{i}.content")
        plain.append({**m, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages: the caller's input
        raise ApiError(400, f"messages: the chat template could not render them: {exc}", "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_message(c: Completion, tools: bool) -> tuple[dict[str, Any], str]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = c.stop_reason.value
    if tools:
        from tokenmill.envs.tools import HermesToolCallParser

        turn = HermesToolCallParser().parse(c.text)
        if turn.tool_calls:
            message = {"role": "assistant", "content": turn.content or None,
                       "tool_calls": [call.openai() for call in turn.tool_calls]}
            reason = "tool_calls" if reason == "stop" else reason
    return message, reason


def _pieces(tokenizer, token_ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


def _text_logprobs(tokenizer, c: Completion) -> dict[str, Any]:
    pieces = _pieces(tokenizer, c.token_ids)
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(tokenizer, c: Completion) -> dict[str, Any]:
    return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                        for piece, lp in zip(_pieces(tokenizer, c.token_ids), c.logprobs, strict=True)]}


def _extras(prompt: list[int], c: Completion, future: RequestFuture) -> dict[str, Any]:
    return {"token_ids": list(c.token_ids), "prompt_token_ids": list(prompt),
            "policy_version": int(future.policy_version or 0)}


def _answer(prefix: str, kind: str, model_name: str, prompts: list[list[int]], futures: list[RequestFuture],
            choices: list[dict[str, Any]]) -> dict[str, Any]:
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "policy_version": min(int(f.policy_version or 0) for f in futures),
    }


# ------------------------------------------------------------------------------------------ running it
def serve(model_dir: str, *, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          allow_remote: bool = False, served_model_name: str | None = None, dtype: str = "float32",
          max_batch: int = 256, seed: int = 0, device: str = "cpu") -> None:
    """Load `model_dir` into a ContinuousEngine and serve it until interrupted; print the URL once it accepts
    connections. Loopback only unless `allow_remote` and a token are both given (ValueError otherwise)."""
    import socket
    import threading
    from pathlib import Path

    import torch
    import uvicorn

    from tokenmill.envs.server import _bound_hosts, is_loopback

    if token is not None and not token:
        raise ValueError("--token: must not be empty")
    if not is_loopback(host) and not (allow_remote and token):
        raise ValueError(f"refusing to serve on non-loopback host {host!r}: bind 127.0.0.1 (and tunnel, e.g. "
                         "`ssh -L`), or pass --allow-remote together with --token")
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"MODEL_DIR {model_dir!r}: not a model folder (no config.json)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype: one of {', '.join(dtypes)}, got {dtype!r}")
    try:
        engine = ContinuousEngine.from_pretrained(model_dir, dtype=dtypes[dtype], device=device, seed=seed,
                                                  max_batch=max_batch)
    except (OSError, ValueError) as exc:
        raise ValueError(f"MODEL_DIR {model_dir!r}: could not load it: {exc}".splitlines()[0]) from None
    name = served_model_name or Path(model_dir).resolve().name
    app = create_app(engine, model_name=name, token=token, allowed_hosts=_bound_hosts(host))
    # proto IPPROTO_TCP, not the default 0: asyncio turns Nagle off only on sockets whose proto says TCP, and with
    # Nagle on, every answer on a kept-alive connection waits ~40 ms for the client's delayed ACK [measured]
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_normalise_host(host), port))
    except OSError as exc:
        sock.close()
        engine.close()
        raise ValueError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30,
                                           timeout_graceful_shutdown=5))

    def announce() -> None:
        deadline = time.monotonic() + 60
        while not server.started and not server.should_exit and time.monotonic() < deadline:
            time.sleep(0.02)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            print(f"tokenmill serve: {name} ready on http://{shown}:{bound}/v1 (auth {'on' if token else 'off'}, "
                  f"max_batch {max_batch}, {dtype})", flush=True)

    threading.Thread(target=announce, name="tokenmill-serve-announce", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
