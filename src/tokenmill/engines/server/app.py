"""`tokenmill serve`: an OpenAI-compatible HTTP server over a continuously batched engine.

    GET  /health                -> {"status": "ok", "policy_version": int, "running_rows", "waiting_requests"}
    GET  /v1/models             -> {"object": "list", "data": [{"id": model_name, "object": "model", ...}]}
    POST /v1/completions        OpenAI body; `prompt` is text, token ids, or a list of either
    POST /v1/chat/completions   OpenAI body; rendered with the model tokenizer's chat template (and `tools`)
    + the weight routes (`tokenmill.engines.server.weight_routes`) and any `extra_routers` (e.g. proxy mode)

Extras on every choice: `token_ids` (the exact sampled ids), `prompt_token_ids`, `policy_version`; on the
answer: `policy_version`, the oldest of its choices' (all tokens of one choice come from one version: the
engine finishes running requests before it swaps weights, see `tokenmill.engines.local.continuous`). Logprobs are
of the sampled token under softmax(logits / temperature), the quantity a trainer recomputes; top
alternatives are not computed (`top_logprobs` is null / empty). `finish_reason` is "stop", "length",
"tool_calls" (chat with `tools`, Hermes `<tool_call>` blocks parsed) or "abort" (interrupted by a weight
update or cancelled). `temperature: 0` is greedy decoding (logprobs then of the temperature-1 distribution).
`prompt_logprobs: k` on /v1/completions (vLLM's extra, token-id prompts or text) adds each choice's
`prompt_logprobs`, vLLM's shape: `[None, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]`, the prompt
token's logprob at temperature 1 and its k most likely alternatives; with `max_tokens: 0` nothing is sampled
(the `Scorer` of a remote engine). `return_routed_experts: true` (tokenmill's extension; a server started with
`--enable-return-routed-experts`) adds each choice's `routed_experts`, vLLM's form of the MoE routing (router
replay r3, `engines.local.routing.encode_routed_experts`). `stream: true` answers with server-sent events, one chunk per token
(`tokenmill.engines.server.streaming`). A client that disconnects cancels its request: the engine stops decoding it at its next step.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 a bad body (`param` names the
field), 401 a missing or wrong bearer token, 403 a foreign `Origin`, 400 a `Host` we do not serve (DNS
rebinding), 413 a body over `max_body_bytes`, 429 the engine's queue is full, 503 the engine is closed or
crashed, 504 no answer in time. The guard, binding and error shape are `tokenmill.serving`'s.

`spawn_servers` starts `serve` in subprocesses on free loopback ports (what `engine.placement: process` uses).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill import serving
from tokenmill.data.images import DEFAULT_MAX_PIXELS, ImagePolicy
from tokenmill.engines.local.continuous import ContinuousEngine, EngineBusy, EngineUnavailable, RequestFuture
from tokenmill.engines.server import openai_wire as wire
from tokenmill.engines.server.openai_wire import ChatBody, CompletionBody, render_chat
from tokenmill.engines.server.proxy_routes import check_episode_id, episode_routes
from tokenmill.engines.server.recorder import EpisodeError, EpisodeRecorder
from tokenmill.engines.server.streaming import Streamer, StreamSpec, TokenFeed, stream
from tokenmill.engines.server.vision_serving import (
    VisionServingEngine,
    completion_images,
    encode_chat,
    image_parts,
)
from tokenmill.sandbox.lifetime import parent_env, preexec_die_with_parent
from tokenmill.serving import ApiError
from tokenmill.serving_limits import ConnectionLimits
from tokenmill.types import Completion, SamplingParams, StopReason, TokenmillError

__all__ = ["Completer", "create_app", "render_chat", "serve", "spawn_servers"]


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body is read by then, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Completer:
    """The two sampling routes over one engine, shared by `/v1/...` and proxy mode's `/proxy/<episode>/v1/...`.

    Tokenising runs in a worker thread (a megabyte prompt must not stall the event loop, /health included),
    after a check that the text cannot fit the model's context, which needs no tokenising at all."""

    def __init__(self, engine, *, model_name: str, request_timeout_s: float, default_max_tokens: int,
                 max_tokens_cap: int | None, recorder: EpisodeRecorder | None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, engine.tokenizer, model_name
        self.request_timeout_s, self.default_max_tokens = request_timeout_s, default_max_tokens
        self.max_tokens_cap, self.recorder = max_tokens_cap, recorder
        self.limit: int | None = getattr(engine, "max_positions", None)
        self._token_chars: int | None = None

    # ------------------------------------------------------------------------------------ checks
    def check_fits(self, text: str, field: str) -> None:
        """400 for text too long for the context whatever its tokens (no entry spells more characters
        than the longest vocabulary entry; 2x margin for normalisers that shorten text)."""
        if not self.limit:
            return
        if self._token_chars is None:
            self._token_chars = wire.longest_token_chars(self.tokenizer)
        least = math.ceil(len(text) / (2 * self._token_chars))
        if least >= self.limit:
            raise ApiError(400, f"{field}: {len(text)} characters are at least {least} tokens, over the model's "
                                f"context of {self.limit} positions", field)

    def check_room(self, prompts: list[list[int]], field: str) -> list[list[int]]:
        longest = max(len(p) for p in prompts)
        if self.limit and longest >= self.limit:
            raise ApiError(400, f"{field}: {longest} tokens leave no room to generate (the model's context is "
                                f"{self.limit} positions)", field)
        return prompts

    def room(self, prompts: list[list[int]]) -> int:
        """Tokens left in the model's context after the longest prompt (the engine refuses a full one)."""
        left = max(1, self.limit - max(len(p) for p in prompts)) if self.limit else 1 << 30
        return min(left, self.max_tokens_cap) if self.max_tokens_cap else left

    def route_layers(self, body: CompletionBody | ChatBody) -> int:
        """The router layers of the routing a request asked for (`return_routed_experts`), 0 when it asked for
        none; 400 when this server does not record (started without --enable-return-routed-experts)."""
        if not body.return_routed_experts:
            return 0
        layers = getattr(self.engine, "routing_layers", 0)
        if not layers:
            raise ApiError(400, "return_routed_experts: this server does not record the routing (serve a "
                                "mixture-of-experts model with --enable-return-routed-experts)", "return_routed_experts")
        return layers

    def check_episode(self, episode_id: str | None, n: int) -> None:
        if episode_id is None:
            return
        check_episode_id(episode_id)
        if n != 1:
            raise ApiError(400, "n: one reply per call in proxy mode (an episode is one trajectory)", "n")

    def record(self, episode_id: str | None, prompt: list[int], future: RequestFuture, shown: Any) -> None:
        """Proxy mode: the call's exact tokens go into its episode (an episode is one trajectory: n = 1)."""
        if episode_id is None:
            return
        [c] = future.result()
        try:
            self.recorder.record(episode_id, prompt, c, int(future.policy_version or 0), prompt=shown)
        except EpisodeError as exc:
            raise ApiError(409, str(exc)) from None

    # ------------------------------------------------------------------------------------ the engine
    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               feed: TokenFeed | None = None, images: Any = None) -> list[RequestFuture]:
        """`images`: the one prompt's `ImageInputs` (a vision-language engine's chat route)."""
        futures: list[RequestFuture] = []
        more = {} if images is None else {"images": images}
        try:
            for i, prompt in enumerate(prompts):
                own = wire.prompt_seed(seed, i)
                if feed is None:  # an engine that cannot stream still serves plain answers
                    futures.append(self.engine.submit(prompt, params, seed=own, **more))
                else:
                    futures.append(self.engine.submit(prompt, params, seed=own, on_token=feed.for_prompt(i, params.n),
                                                      **more))
                    feed.watch(i, futures[-1])
        except ValueError as exc:  # the engine names the field ("prompt: ...", "n: ...")
            self._cancel(futures)
            raise ApiError(400, str(exc), serving.field_of(str(exc))) from None
        except EngineBusy as exc:
            self._cancel(futures)
            raise ApiError(429, str(exc)) from None
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc)) from None
        return futures

    def _cancel(self, futures: list[RequestFuture]) -> None:
        for f in futures:
            if not f.done():
                self.engine.cancel(f)

    async def wait(self, futures: list[RequestFuture], request: Request) -> None:
        """All answers, or an error; the requests are cancelled when the client goes away or time runs out."""
        answers = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({answers, gone}, timeout=self.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if answers in done:
                answers.result()
            elif gone in done:
                raise ApiError(499, "the client closed the connection; the request was cancelled")
            else:
                raise ApiError(504, f"no answer within {self.request_timeout_s:g}s; the request was cancelled")
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc)) from None
        finally:
            gone.cancel()
            answers.cancel()
            self._cancel(futures)

    def streamed(self, spec: StreamSpec, params: SamplingParams, seed: int | None, episode_id: str | None,
                 shown: Any, images: Any = None) -> StreamingResponse:
        feed = TokenFeed(asyncio.get_running_loop())
        futures = self.submit(spec.prompts, params, seed, feed, images)

        def on_done(done: list[RequestFuture]) -> None:
            self.record(episode_id, spec.prompts[0], done[0], shown)

        chunks = stream(Streamer(self.tokenizer, spec), feed, futures, timeout_s=self.request_timeout_s,
                        cancel=self.engine.cancel, on_done=on_done)
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def _spec(self, body: CompletionBody | ChatBody, prompts: list[list[int]], chat: bool) -> StreamSpec:
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        return StreamSpec(chat=chat, model_name=self.model_name, prompts=prompts, n=body.n, logprobs=logprobs,
                          tools=chat and bool(body.tools), stops=stops,
                          include_usage=bool((body.stream_options or {}).get("include_usage")))

    # ------------------------------------------------------------------------------------ the routes
    async def text(self, body: CompletionBody, request: Request, episode_id: str | None = None) -> Any:
        self.check_episode(episode_id, body.n)
        wire.refuse_unsupported(body)
        for p in [body.prompt] if isinstance(body.prompt, str) else body.prompt:
            if isinstance(p, str):
                self.check_fits(p, "prompt")
        scoring_only = body.max_tokens == 0
        prompts = await asyncio.to_thread(lambda: wire.completion_prompts(self.tokenizer, body.prompt))
        if not scoring_only:
            self.check_room(prompts, "prompt")
        if episode_id is not None and len(prompts) != 1:
            raise ApiError(400, "prompt: one prompt per call in proxy mode", "prompt")
        images = None
        if body.images:
            if body.prompt_logprobs is not None:
                raise ApiError(400, "prompt_logprobs: not with images", "prompt_logprobs")
            images = await asyncio.to_thread(completion_images, self.engine, body.images, prompts)
        layers = self.route_layers(body)
        scored = None if body.prompt_logprobs is None else await self.score(prompts, body.prompt_logprobs)
        if scoring_only:
            return self.scored_answer(prompts, scored)
        params = wire.sampling(body, min(body.max_tokens or 16, self.room(prompts)))
        if body.stream:
            return self.streamed(self._spec(body, prompts, chat=False), params, body.seed, episode_id, body.prompt,
                                 images)
        futures = self.submit(prompts, params, body.seed, images=images)
        await self.wait(futures, request)
        choices = []
        for i, (prompt, future) in enumerate(zip(prompts, futures, strict=True)):
            for j, c in enumerate(future.result()):
                logprobs = None if body.logprobs is None else wire.text_logprobs(self.tokenizer, c.token_ids,
                                                                                 c.logprobs)
                choice = {"index": i * body.n + j, "text": c.text, "finish_reason": c.stop_reason.value,
                          "logprobs": logprobs}
                if scored is not None:
                    choice["prompt_logprobs"] = scored[i]
                choices.append(choice | wire.extras(prompt, c, future.policy_version, layers))
        self.record(episode_id, prompts[0], futures[0], body.prompt)
        head = wire.envelope("cmpl", "text_completion", self.model_name)
        return wire.answer(head, prompts, [f.policy_version for f in futures], choices)

    async def score(self, prompts: list[list[int]], top_k: int) -> list[list[Any]]:
        """Each prompt's `prompt_logprobs` (vLLM's shape) from the engine's `score_ranked`; 400 for a bad one."""
        from tokenmill.engines.local.scoring import check_score_request

        ranked = getattr(self.engine, "score_ranked", None)
        if ranked is None:
            raise ApiError(400, "prompt_logprobs: this engine cannot score prompts", "prompt_logprobs")
        try:
            check_score_request(prompts, top_k, getattr(self.engine, "vocab_size", 1 << 62), self.limit, field="prompt",
                                top_field="prompt_logprobs")
            answers = await asyncio.to_thread(ranked, prompts, top_k)
        except ValueError as exc:
            raise ApiError(400, str(exc), serving.field_of(str(exc))) from None
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc)) from None
        return [wire.prompt_logprobs(self.tokenizer, p, scored, ranks)
                for p, (scored, ranks) in zip(prompts, answers, strict=True)]

    def scored_answer(self, prompts: list[list[int]], scored: list[list[Any]]) -> dict[str, Any]:
        """The answer to a scoring-only request (max_tokens 0): one empty choice per prompt, with its scores."""
        version, empty = int(self.engine.version), Completion((), (), StopReason.LENGTH, "")
        choices = [{"index": i, "text": "", "finish_reason": "length", "logprobs": None, "prompt_logprobs": s}
                   | wire.extras(p, empty, version) for i, (p, s) in enumerate(zip(prompts, scored, strict=True))]
        head = wire.envelope("cmpl", "text_completion", self.model_name)
        return wire.answer(head, prompts, [version], choices)

    async def chat(self, body: ChatBody, request: Request, episode_id: str | None = None) -> Any:
        self.check_episode(episode_id, body.n)
        wire.refuse_unsupported(body)

        def render() -> tuple[list[int], Any]:
            if getattr(self.engine, "takes_images", False):  # a vision-language model: images read here
                if body.tools or body.chat_template_kwargs:
                    raise ApiError(400, "tools: not with a vision-language model", "tools")
                ids, images = encode_chat(self.engine.processor, body.messages, self.engine.policy)
                return self.check_room([ids], "messages")[0], images
            refuse_images(body.messages)
            text = wire.chat_text(self.tokenizer, body.messages, body.tools, body.chat_template_kwargs)
            self.check_fits(text, "messages")
            return self.check_room([list(self.tokenizer(text, add_special_tokens=False)["input_ids"])],
                                   "messages")[0], None

        layers = self.route_layers(body)
        prompt, images = await asyncio.to_thread(render)
        wanted = body.max_completion_tokens or body.max_tokens or self.default_max_tokens
        params = wire.sampling(body, min(wanted, self.room([prompt])))
        if body.stream:
            return self.streamed(self._spec(body, [prompt], chat=True), params, body.seed, episode_id, body.messages,
                                 images)
        [future] = futures = self.submit([prompt], params, body.seed, images=images)
        await self.wait(futures, request)
        choices = []
        for j, c in enumerate(future.result()):
            message, reason = wire.chat_message(c, bool(body.tools))
            logprobs = wire.chat_logprobs(self.tokenizer, c.token_ids, c.logprobs) if body.logprobs else None
            choice = {"index": j, "message": message, "finish_reason": reason, "logprobs": logprobs}
            choices.append(choice | wire.extras(prompt, c, future.policy_version, layers))
        self.record(episode_id, prompt, future, body.messages)
        head = wire.envelope("chatcmpl", "chat.completion", self.model_name)
        return wire.answer(head, [prompt], [future.policy_version], choices)


def refuse_images(messages: list[dict[str, Any]]) -> None:
    """400 naming the first image part sent to a text-only model (its pictures would be dropped unseen)."""
    found = image_parts(messages)
    if found:
        raise ApiError(400, f"{found[0][0]}: this model reads no images (serve a vision-language model folder)",
                       found[0][0])


# ------------------------------------------------------------------------------------------ the app
def create_app(engine, *, model_name: str, token: str | None = None, extra_routers: Iterable[APIRouter] = (),
               allowed_hosts: Iterable[str] = (), request_timeout_s: float = 600.0,
               default_max_tokens: int = 1024, max_tokens_cap: int | None = None,
               recorder: EpisodeRecorder | None = None,
               max_body_bytes: int = serving.DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible app over `engine` (a ContinuousEngine, or anything with `submit`, `cancel`,
    `tokenizer`, `version`).

    token:              when set, every route but /health needs `Authorization: Bearer <token>`
    allowed_hosts:      `Host` names served besides localhost / 127.0.0.1 / [::1]; "*" turns the check off
                        (only behind a token, e.g. bound to 0.0.0.0)
    request_timeout_s:  a request without an answer by then is cancelled (504)
    default_max_tokens: a chat request's `max_tokens` when it sends none (capped by the context left)
    max_tokens_cap:     the most tokens any request may generate (None: the context left)
    recorder:           proxy mode (`recorder.EpisodeRecorder`): the same two routes are also served under
                        `/proxy/<episode id>/v1/...`, one reply per call, each recorded into the episode;
                        `/v1/episodes/<id>/reward` ends an episode (see `proxy_routes.py`)
    max_body_bytes:     larger request bodies are refused (413) before they are read
    """
    app = FastAPI(title="tokenmill engine server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    serving.Guard.install(app, token=token, allowed_hosts=serving.host_set(allowed_hosts),
                          max_body_bytes=max_body_bytes)
    serving.install_openai_errors(app)
    completer = Completer(engine, model_name=model_name, request_timeout_s=request_timeout_s,
                          default_max_tokens=default_max_tokens, max_tokens_cap=max_tokens_cap, recorder=recorder)
    app.state.completer = completer
    _routes(app, engine, completer, model_name)
    weight_routes = _weight_routes(engine)
    if weight_routes is not None:
        app.include_router(weight_routes)
    for router in extra_routers:
        app.include_router(router)
    return app


def _routes(app: FastAPI, engine, completer: Completer, model_name: str) -> None:
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

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Any:
        return _json(await completer.text(body, request))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        return _json(await completer.chat(body, request))

    if completer.recorder is None:
        return

    # proxy mode: the same answers, each call recorded into its episode
    @app.post("/proxy/{episode_id}/v1/completions", response_model=None)
    async def proxy_completions(episode_id: str, body: CompletionBody, request: Request) -> Any:
        return _json(await completer.text(body, request, episode_id))

    @app.post("/proxy/{episode_id}/v1/chat/completions", response_model=None)
    async def proxy_chat_completions(episode_id: str, body: ChatBody, request: Request) -> Any:
        return _json(await completer.chat(body, request, episode_id))

    app.get("/proxy/{episode_id}/v1/models")(models)
    app.include_router(episode_routes(completer.recorder))


def _json(answer: Any) -> Any:
    """An answer as it goes out: a plain dict straight to JSON (FastAPI would otherwise walk it value by value
    with `jsonable_encoder`: a quarter of the server's time on a batch of 128 choices), a stream as it is."""
    return JSONResponse(answer) if isinstance(answer, dict) else answer


def _weight_routes(engine) -> APIRouter | None:
    """The "sync" side's routes, when that module is there (imported late: it pulls in torch.distributed)."""
    try:
        from tokenmill.engines.server.weight_routes import weight_routes
    except ModuleNotFoundError as exc:
        if exc.name != "tokenmill.engines.server.weight_routes":
            raise
        return None
    return weight_routes(engine)


# ------------------------------------------------------------------------------------------ running it
def serve(model_dir: str, *, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          allow_remote: bool = False, served_model_name: str | None = None, dtype: str = "float32",
          max_batch: int = 256, max_batch_tokens: int = 0, seed: int = 0, device: str = "cpu",
          max_body_bytes: int = serving.DEFAULT_MAX_BODY_BYTES, limits: ConnectionLimits | None = None,
          kv_cache: str = "static", kv_block_size: int = 16, allow_remote_images: bool = False,
          max_image_pixels: int = DEFAULT_MAX_PIXELS, return_routed_experts: bool = False) -> None:
    """Load `model_dir` into a ContinuousEngine and serve it until interrupted; once it accepts connections,
    print its `serving.ready_line` (port 0 binds a free port, named there). Loopback only unless `allow_remote`
    and a token are both given (ValueError otherwise). `limits`: read timeout and connection cap.
    A vision-language folder (a `vision_config` in config.json) is served by a `VisionServingEngine`: chat
    messages may carry `image_url` parts, fetched from http(s) only with `allow_remote_images`, each at most
    `max_image_pixels` (width x height). `return_routed_experts`: record a mixture-of-experts model's routing,
    returned to requests that ask (`return_routed_experts`, for router replay r3)."""
    import torch

    serving.check_exposure(host, token, allow_remote)
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"MODEL_DIR {model_dir!r}: not a model folder (no config.json)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype: one of {', '.join(dtypes)}, got {dtype!r}")
    if max_batch_tokens < 0:
        raise ValueError(f"--max-batch-tokens: must be >= 0 (0 = no limit), got {max_batch_tokens}")
    sock = serving.bind(host, port)
    try:
        if _is_vision_folder(model_dir):
            policy = ImagePolicy(allow_remote=allow_remote_images, max_pixels=max_image_pixels)
            engine = VisionServingEngine.from_pretrained(model_dir, dtype=dtypes[dtype], device=device, seed=seed,
                                                         policy=policy)
        else:
            engine = ContinuousEngine.from_pretrained(model_dir, dtype=dtypes[dtype], device=device, seed=seed,
                                                      max_batch=max_batch, max_batch_tokens=max_batch_tokens,
                                                      kv_cache=kv_cache, kv_block_size=kv_block_size)
    except (OSError, ValueError) as exc:
        sock.close()
        raise ValueError(f"MODEL_DIR {model_dir!r}: could not load it: {exc}".splitlines()[0]) from None
    if return_routed_experts:
        _record_routing(engine, sock)
    name = served_model_name or Path(model_dir).resolve().name
    app = create_app(engine, model_name=name, token=token, allowed_hosts=serving.bind_names(host),
                     max_body_bytes=max_body_bytes)
    url = serving.url_of(host, sock.getsockname()[1])

    def ready() -> None:
        print(serving.ready_line(f"tokenmill serve: {name}", f"{url}/v1",
                                 f"auth {'on' if token else 'off'}, max_batch {max_batch}, {dtype}"), flush=True)

    try:
        serving.serve_forever(app, sock, on_ready=ready, limits=limits)
    finally:
        engine.close()


def _record_routing(engine, sock) -> None:
    """`--enable-return-routed-experts`: the engine records its routing, or a one-line refusal."""
    from tokenmill.engines.local.routing import moe_routers

    if not isinstance(engine, ContinuousEngine) or not moe_routers(engine.model):
        engine.close()
        sock.close()
        raise ValueError("--enable-return-routed-experts: the model has no mixture-of-experts router to record "
                         "(a text model of a family with transformers' top-k routers, e.g. Qwen3-MoE)")
    engine.record_routing(True)


def _is_vision_folder(model_dir: str) -> bool:
    import json

    try:
        return "vision_config" in json.loads(Path(model_dir, "config.json").read_text())
    except (OSError, ValueError):
        return False


def spawn_servers(model_dir: str, count: int, *, threads: int = 0, timeout_s: float = 120.0, seed: int = 0,
                  device: str = "cpu", log_dir: Path | None = None,
                  extra_args: tuple[str, ...] = ()) -> tuple[list[str], list[subprocess.Popen]]:
    """Start `count` `tokenmill serve MODEL_DIR --port 0` processes (each binds a free loopback port and names
    it in its ready line, so no port can be taken in between) and wait until each is ready. `extra_args`: more
    `tokenmill serve` flags (e.g. `--kv-cache paged`)."""
    urls, procs = [], []
    env = parent_env(dict(os.environ))  # `tokenmill serve` watches for this process
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        for i in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", "serve", model_dir, "--port", "0", "--seed",
                 str(seed + i), "--device", device, *extra_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                # a kill -9 of the trainer takes its servers along; the hook only calls prctl and getppid
                preexec_fn=preexec_die_with_parent(),  # noqa: PLW1509
            ))
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(procs):
            log = open(log_dir / f"server_{i}.log", "wb") if log_dir else None  # noqa: SIM115
            try:
                port = serving.wait_for_port(proc, timeout_s=max(0.0, deadline - time.monotonic()), log=log)
            except (TimeoutError, ChildProcessError) as exc:
                raise TokenmillError(f"engine.placement process: `tokenmill serve` #{i} {exc} "
                                     f"(engine.timeout_s={timeout_s:g}s)") from None
            urls.append(f"http://127.0.0.1:{port}")
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return urls, procs
