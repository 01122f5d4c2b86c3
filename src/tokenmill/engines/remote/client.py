"""An `InferenceEngine` over OpenAI-compatible servers: tokenmill's own (`tokenmill serve`), vLLM or SGLang.

    >>> engine = RemoteEngine(["http://127.0.0.1:8000"], pad_id=0)                       # doctest: +SKIP
    >>> [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))              # doctest: +SKIP
    >>> len(c.token_ids) == len(c.logprobs)                                              # doctest: +SKIP
    True

Prompts go out as token ids (`/v1/completions` takes a list of ints as the prompt), so the server never
re-tokenises what the trainer will train on, and the answer's `token_ids` (vLLM's `return_token_ids`, also
understood by tokenmill's server) are the exact sampled tokens. Each prompt is one request with `n` samples,
so a GRPO group shares one prefill on the server; the prompts of a batch go out concurrently, and the
servers' continuous batching turns them into one running batch. With `prompts_per_request=0` a call's
prompts go out as one request per live server instead (a list of token-id lists, the answer's choices in
prompt order): one HTTP round trip and one admission per server rather than one per prompt (on the 2-core
machine, 16 prompts x 8 samples x 8 tokens to one `tokenmill serve`: 36 ms against 71 ms).

A vision-language prompt (`images=True`) goes out as its token ids (its image tokens laid out by the trainer's
processor) plus `images`: its pictures as `image_url` parts with PNG data URLs, tokenmill serve's extension of
the completions body; the server's image processor turns them into the pixels the trainer reads. Servers
that take images only in chat (vLLM, SGLang, any OpenAI-compatible one: `image_route="chat"`, what
`engine.placement: remote` uses) get the prompt's chat messages on `/v1/chat/completions`, each image slot an
OpenAI `image_url` part whose data URL holds the very pixels the trainer's processor read (a file is read here,
a remote URL was fetched here only because `data.allow_remote_images` allowed it; the server never fetches);
the server renders the messages itself, so its `prompt_token_ids` must equal the run's ids or the request fails
(the samples would be trained on tokens the server did not condition on).

What must match on the server side for the logprobs to be the trainer's quantity (the tempered
distribution's logprob of each sampled token): tokenmill's server does this by default; vLLM needs
`--logprobs-mode processed_logprobs`; SGLang returns the tempered logprobs when the request has
`"return_logprob": true` (its native API). See docs/engine-server.md ("Remote engines").

Weights: `update_weights` hands the tensors to a `tokenmill.sync` weight sync (files or broadcast), which
pushes them to every server; the version each server reports back is the one its samples carry.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engines.base import call_seed
from tokenmill.engines.local.routing import decode_routed_experts
from tokenmill.engines.remote.pool import EndpointPool
from tokenmill.types import Completion, ImageInputs, PromptLogprobs, SamplingParams, StopReason

if TYPE_CHECKING:  # annotation only: an engine import need not load the sync package and its transports
    from tokenmill.sync.base import WeightSync


class RemoteEngine:
    """Samples from one or more OpenAI-compatible servers, with load balancing and failover (`EndpointPool`).

    urls:          server base URLs ("http://host:port", no /v1)
    pad_id:        the tokenizer's pad id (the trainer pads with it; the engine itself never pads)
    model:         the served model name sent in requests (vLLM and SGLang check it; ours accepts any)
    sync:          how `update_weights` reaches the servers (a `tokenmill.sync` WeightSync); None: refuse
    max_parallel:  requests in flight at once across all servers
    prompts_per_request: prompts sent in one request (1: one request per prompt, what any server takes; 0: a
                   call's prompts split evenly, one request per live server)
    images:        a vision-language policy (`takes_images`): `generate(..., images=)` takes each prompt's
                   `ImageInputs`, sent as data-URL `image_url` parts beside its token ids (one request per prompt)
    image_route:   where a prompt with images goes: "completions" (its token ids plus tokenmill serve's `images`
                   field) or "chat" (its chat messages with `image_url` parts on /v1/chat/completions, what
                   vLLM and other OpenAI-compatible servers take; the prompt must carry `messages`)
    seed:          None: the servers sample with their own RNGs. An int: each request carries the seed
                   `call_seed(seed, version, index of its first prompt since the last weight push)`, and the
                   server gives prompt i of a request seed + i (tokenmill serve does), so what the servers draw
                   does not depend on what they served before: a client made afresh at the same version (a
                   resumed run) draws what the first one drew
    routed_experts: a mixture-of-experts policy's routing per completion (router replay r3), which every
                   answer must then carry: "ask" sends `return_routed_experts` with each request (tokenmill serve's
                   extension; the server started with --enable-return-routed-experts); "server": the server sends
                   it unasked (vLLM started with --enable-return-routed-experts); "off": not needed. A choice's
                   `routed_experts` (vLLM's form, both servers') becomes `Completion.routes` whenever it is there
    """

    def __init__(self, urls: list[str], *, pad_id: int, token: str | None = None, model: str = "tokenmill",
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5, cooldown_s: float = 5.0,
                 sync: WeightSync | None = None, max_parallel: int = 256, prompts_per_request: int = 1,
                 seed: int | None = None, images: bool = False, routed_experts: str = "off",
                 image_route: str = "completions") -> None:
        if image_route not in ("completions", "chat"):
            raise ValueError(f"image_route: 'completions' or 'chat', got {image_route!r}")
        self.image_route = image_route
        self.pool = EndpointPool(urls, token=token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                 cooldown_s=cooldown_s)
        self.pad_id = pad_id
        self.model = model
        self.sync = sync
        self.prompts_per_request = prompts_per_request
        self.seed = seed
        if routed_experts not in ("off", "ask", "server"):
            raise ValueError(f"routed_experts: off, ask or server, got {routed_experts!r}")
        self.routed_experts = routed_experts
        self.takes_images = images  # `rollout.generator.build_generator` then gives it a generator that reads images
        self._drawn = self._start = 0  # prompts drawn since the last push; the first of the call in progress
        self.version = 0
        self.versions_seen: list[int] = []
        self._workers = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="tokenmill-remote")

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[ImageInputs | None] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt; `images[i]`: prompt i's images (a vision-language server only)."""
        if not prompts:
            return []
        self._start, self._drawn = self._drawn, self._drawn + len(prompts)
        pictures = None
        if images is not None and any(x is not None for x in images):
            pictures = [image_parts(x) for x in images]
            spans = [(i, i + 1) for i in range(len(prompts))]  # one prompt and its pictures per request
        else:
            spans = self._spans(len(prompts))

        chat = {i for i in range(len(prompts)) if pictures and pictures[i] and self.image_route == "chat"}

        def post(span: tuple[int, int]) -> dict[str, Any]:
            if span[0] in chat:
                body = self._chat_body(prompts[span[0]], images[span[0]], params, span[0])
                return self.pool.post("/v1/chat/completions", body)
            body = self._body(prompts[span[0]:span[1]], params, span[0])
            if pictures is not None and pictures[span[0]]:
                body["images"] = pictures[span[0]]
            return self.pool.post("/v1/completions", body)

        answers = list(self._workers.map(post, spans))
        out: list[list[Completion]] = []
        for (start, end), answer in zip(spans, answers, strict=True):
            if "policy_version" in answer:
                self.versions_seen.append(int(answer["policy_version"]))
            choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
            if len(choices) != (end - start) * params.n:
                raise ValueError(f"the engine server answered {len(choices)} choices for {end - start} prompt(s) "
                                 f"x n={params.n}")
            if start in chat:
                out.append([_chat_completion(c, answer, prompts[start], self.routed_experts != "off")
                            for c in choices])
                continue
            out += [[_completion(c, len(prompts[start + i]), self.routed_experts != "off")
                     for c in choices[i * params.n:(i + 1) * params.n]] for i in range(end - start)]
        return out

    def _spans(self, count: int) -> list[tuple[int, int]]:
        """[start, end) of the prompts each request carries (`prompts_per_request`)."""
        per = self.prompts_per_request or -(-count // max(1, len(self.pool.endpoints)))
        return [(start, min(count, start + per)) for start in range(0, count, per)]

    def _body(self, prompts: list[list[int]], params: SamplingParams, first: int) -> dict[str, Any]:
        """The completions body of `prompts`, the call's prompts from index `first` on."""
        one = len(prompts) == 1  # a single prompt as a list of ints, which every server takes
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(prompts[0]) if one else [list(p) for p in prompts],
            "max_tokens": params.max_tokens, "n": params.n,
            "temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
            "logprobs": 1, "return_token_ids": True,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        if self.routed_experts == "ask":
            body["return_routed_experts"] = True
        if self.seed is not None:
            body["seed"] = call_seed(self.seed, self.version, self._start + first)
        return body

    def _chat_body(self, prompt: list[int], inputs: ImageInputs, params: SamplingParams,
                   first: int) -> dict[str, Any]:
        """The chat completions body of a prompt with images: its messages, image slots as `image_url` parts."""
        messages = getattr(prompt, "messages", None)
        if messages is None:
            raise ValueError("a prompt with images has no chat messages to send (image_route 'chat' takes "
                             "single-turn prompts; multi-turn episodes with images need engine.placement "
                             "colocated or process)")
        body = self._body([prompt], params, first)
        del body["prompt"]
        body |= {"messages": chat_messages(messages, inputs), "logprobs": True}
        return body

    # ------------------------------------------------------------------------------------------- scoring
    def score(self, sequences: list[list[int]], top_k: int = 0) -> list[PromptLogprobs]:
        """`Scorer` through one server: vLLM's `prompt_logprobs` (tokenmill serve and vLLM both answer it; one
        sampled token is asked for and dropped, as vLLM samples at least one)."""
        if top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {top_k}")
        if any(not s for s in sequences):
            raise ValueError("sequences: a sequence is empty (at least one token)")
        answers = list(self._workers.map(lambda s: self.pool.post("/v1/completions", self._score_body(s, top_k)),
                                         sequences))
        return [_prompt_logprobs(s, a, top_k) for s, a in zip(sequences, answers, strict=True)]

    def score_each(self, sequences: list[list[int]], top_k: int = 0) -> dict[str, list[PromptLogprobs]]:
        """`score` on every live server (url -> scores, for the servers that answered every sequence): what the
        weight-sync probe compares, one server at a time."""
        out: dict[str, list[PromptLogprobs]] = {}
        for s in sequences:
            for url, answer in self.pool.post_live("/v1/completions", self._score_body(s, top_k)).items():
                out.setdefault(url, []).append(_prompt_logprobs(s, answer, top_k))
        return {url: scores for url, scores in out.items() if len(scores) == len(sequences)}

    def _score_body(self, ids: list[int], top_k: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": top_k}

    # ------------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.sync is None:
            raise RuntimeError("RemoteEngine has no weight sync: pass sync=FileSync(...) or BroadcastSync(...) "
                               "(tokenmill.sync), or set engine.sync in the config")
        self.sync.push(named_tensors, version)
        self.version = version
        self._drawn = 0
        servers = getattr(self.sync, "servers", None)  # files and broadcast syncs drop a server that did not answer
        if servers is not None:
            self.pool.retire({e.url for e in self.pool.endpoints} - {u.rstrip("/") for u in servers.urls})

    def state_dict(self) -> dict[str, Any]:
        """Empty: the servers sample with their own RNGs (seeded per request when asked)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def health(self) -> dict[str, bool]:
        return self.pool.probe()

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
        if self.sync is not None and hasattr(self.sync, "close"):
            self.sync.close()


def image_parts(inputs: ImageInputs | None) -> list[dict[str, Any]]:
    """A prompt's images as OpenAI `image_url` parts with lossless PNG data URLs (the server's image processor
    then reads the very pixels the trainer's did)."""
    if inputs is None:
        return []
    if len(inputs.pictures) != inputs.num_images:
        raise ValueError(f"a prompt's ImageInputs holds {len(inputs.pictures)} pictures for {inputs.num_images} "
                         "images: a remote engine sends the pictures themselves (VisionProcessor.pixels keeps them)")
    parts = []
    for picture in inputs.pictures:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def chat_messages(messages: list[dict[str, Any]], inputs: ImageInputs) -> list[dict[str, Any]]:
    """Chat messages whose image slots (`{"type": "image"}` parts, in order) are `inputs`' pictures as OpenAI
    `image_url` parts with PNG data URLs."""
    parts = iter(image_parts(inputs))
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [next(parts) if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
        out.append({**message, "content": content})
    if next(parts, None) is not None:
        raise ValueError(f"the prompt's messages have fewer image slots than its {inputs.num_images} images")
    return out


def _chat_completion(choice: dict[str, Any], answer: dict[str, Any], prompt: list[int],
                     routed: bool = False) -> Completion:
    """A chat answer's choice as a `Completion` (its `token_ids` and `logprobs.content`); the server's prompt ids
    (vLLM's top-level `prompt_token_ids`, tokenmill serve's per choice) must be the run's."""
    served = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
    if served is not None and [int(t) for t in served] != list(prompt):
        raise ValueError(f"the engine server rendered the chat prompt as {len(served)} tokens that differ from the "
                         f"run's {len(prompt)} (its chat template or image processor is not the run's model's)")
    content = (choice.get("logprobs") or {}).get("content")
    if content is None or choice.get("token_ids") is None:
        raise ValueError("the engine server's chat answer has no token_ids/logprobs: tokenmill needs the exact "
                         "sampled tokens (vLLM: return_token_ids; tokenmill serve does by default)")
    text = (choice.get("message") or {}).get("content") or ""
    return _completion({**choice, "text": text, "logprobs": {"token_logprobs": [e["logprob"] for e in content]}},
                       len(prompt), routed)


def _completion(choice: dict[str, Any], prompt_len: int, routed: bool = False) -> Completion:
    """A choice of an OpenAI completions answer as a `Completion`; needs the token ids and their logprobs; its
    `routed_experts`, where there, become the routes of the prompt's and the completion's tokens."""
    ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or logprobs is None:
        raise ValueError("the engine server's answer has no token_ids/logprobs: tokenmill needs the exact sampled "
                         "tokens (vLLM: send return_token_ids; tokenmill serve does by default)")
    if len(ids) != len(logprobs):
        raise ValueError(f"the server returned {len(ids)} token ids but {len(logprobs)} logprobs")
    reason = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT}.get(choice.get("finish_reason"),
                                                                          StopReason.STOP)
    experts = choice.get("routed_experts")
    if routed and not experts and choice.get("finish_reason") != "abort":  # (vLLM: none before a first forward)
        raise ValueError("the engine server's answer has no routed_experts: router replay r3 needs a server that "
                         "records them (tokenmill serve or vLLM started with --enable-return-routed-experts, on a "
                         "mixture-of-experts model)")
    routes = None if not experts else decode_routed_experts(experts, prompt_len + len(ids))
    return Completion(tuple(int(t) for t in ids), tuple(float(x) for x in logprobs), reason,
                      choice.get("text", ""), routes=routes)


def _prompt_logprobs(ids: list[int], answer: dict[str, Any], top_k: int) -> PromptLogprobs:
    """An answer's vLLM-shaped `prompt_logprobs` (None, then {"<id>": {"logprob", "rank", ...}} per token) as a
    `PromptLogprobs`: the prompt token's logprob, the `top_k` alternatives of rank <= top_k, and the
    answer's `policy_version` where the server gives one (tokenmill serve does; vLLM does not)."""
    choice = answer["choices"][0]
    version = answer.get("policy_version", choice.get("policy_version"))
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise ValueError("the engine server's answer has no prompt_logprobs for each prompt token (tokenmill serve "
                         "and vLLM answer `prompt_logprobs`)")
    picked, tops = [], []
    for t, entry in zip(ids[1:], entries[1:], strict=True):
        picked.append(float(entry[str(t)]["logprob"]))
        ranked = sorted(((int(k), v) for k, v in entry.items()), key=lambda kv: -kv[1]["logprob"])
        tops.append({k: float(v["logprob"]) for k, v in ranked[:top_k]})
    return PromptLogprobs(tuple(picked), tuple(tops) if top_k else None,
                          int(version) if isinstance(version, int) else None)
