"""`tokenmill serve` over a vision-language model folder: chat messages with `image_url` parts.

`VisionServingEngine` puts the in-process `VisionEngine` behind the interface the server's routes use
(`submit` / `cancel` / `tokenizer` / `version`): one worker thread takes every request waiting when it is free
(at most `max_batch_requests`) and decodes them together (`engines.local.vision_batch.decode_together`), each
prompt's images through the vision encoder once for its `n` samples; a seeded request draws what it draws
alone. `encode_chat` turns OpenAI chat messages into the
prompt's token ids and pixels; an image that cannot be used (corrupt, missing, larger than the server's
`max_image_pixels`, remote without `--allow-remote-images`) is a 400 naming its part
(`messages.0.content.1`), never a 500.

Accepted image parts: `{"type": "image_url", "image_url": {"url": ...}}` with a `data:image/...;base64,...` URL,
a local file path or a `file://` URL (an `http(s)://` URL only when the server allows remote images).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.data.images import DEFAULT_MAX_PIXELS, ImageError, ImagePolicy, load_image
from tokenmill.engines.local.continuous import EngineUnavailable, RequestFuture
from tokenmill.serving import ApiError
from tokenmill.types import ImageInputs, SamplingParams

_IMAGE_PARTS = ("image_url", "image")


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(`messages.i.content.j`, the part's image reference) of every image part, in order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _IMAGE_PARTS:
                continue
            ref = part.get("image_url") if part["type"] == "image_url" else part.get("image")
            ref = ref.get("url") if isinstance(ref, dict) else ref
            found.append((f"messages.{i}.content.{j}", ref))
    return found


def _slots(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part a bare `{"type": "image"}` slot (what the chat template renders)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS else p
                       for p in content]
        out.append({**message, "content": content})
    return out


def _load(found: list[tuple[str, Any]], policy: ImagePolicy) -> list[Any]:
    """The RGB images of (field, reference) pairs; `ApiError` 400 naming the field of the first bad one."""
    images = []
    for field, ref in found:
        if not isinstance(ref, str) or not ref:
            raise ApiError(400, f"{field}: image_url.url must be a data URL, a file path or a file:// URL", field)
        try:
            images.append(load_image(ref, policy, field))
        except ImageError as exc:
            message = str(exc).replace("data.allow_remote_images: true", "start the server with --allow-remote-images")
            message = message.replace("data.max_image_pixels", "the server's --max-image-pixels")
            raise ApiError(400, message, field) from None
    return images


def encode_chat(processor, messages: list[dict[str, Any]], policy: ImagePolicy) -> tuple[list[int], ImageInputs | None]:
    """(prompt token ids, its `ImageInputs` or None) of OpenAI chat messages; `ApiError` 400 for a bad image
    (naming its part) or messages the chat template cannot render."""
    found = image_parts(messages)
    images = _load(found, policy)
    try:
        return processor.encode(_slots(messages), images, tuple(field for field, _ in found))
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages: the caller's input
        raise ApiError(400, f"messages: could not render them with their images: {exc}"[:2000], "messages") from None


def completion_images(engine, parts: list[Any], prompts: list[list[int]]) -> ImageInputs:
    """The `ImageInputs` of a completions request's `images` (tokenmill's extension: one token-id prompt whose
    image tokens the client laid out, and its pictures as `image_url` parts, in order); 400 when the model
    reads no images, a picture is bad, or the prompt's image tokens do not fit the pictures' grids."""
    if not getattr(engine, "takes_images", False):
        raise ApiError(400, "images: this model reads no images (serve a vision-language model folder)", "images")
    if len(prompts) != 1:
        raise ApiError(400, "images: one prompt per request with images", "images")
    found = []
    for k, part in enumerate(parts):
        url = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
        found.append((f"images.{k}", url.get("url") if isinstance(url, dict) else url))
    processor = engine.processor
    inputs = processor.pixels(_load(found, engine.policy), tuple(field for field, _ in found))
    want = int((inputs.image_grid_thw.prod(-1) // processor.merge**2).sum())
    have = _image_slots(prompts[0], processor.image_token_id, processor.vision_start_id)
    if have != want:
        raise ApiError(400, f"images: the prompt has {have} image tokens for pictures that make {want}", "images")
    return inputs


def _image_slots(ids: list[int], image_id: int, start_id: int) -> int:
    """Image tokens in runs right after a vision-start token (as `engines.local.vision.image_slots` reads them)."""
    count, opened = 0, False
    for t in ids:
        if t == image_id:
            count += opened
        else:
            opened = t == start_id
    return count


class VisionServingEngine:
    """A `VisionEngine` and its processor behind the server's engine interface. `submit(..., images=)` takes
    the prompt's `ImageInputs`; requests run in order on one thread. Streaming callbacks get a choice's tokens
    when it is complete (the vision engine decodes a group in one call)."""

    takes_images = True

    def __init__(self, engine, processor, *, policy: ImagePolicy | None = None, max_batch_requests: int = 16) -> None:
        self.engine, self.processor, self.tokenizer = engine, processor, processor.tokenizer
        self.model = engine.model  # the weight routes load into it
        self.policy = policy or ImagePolicy(max_pixels=DEFAULT_MAX_PIXELS)
        self.max_positions = engine.max_positions
        self.max_batch_requests = max_batch_requests
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision-engine")
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._pending: deque = deque()  # (future, request, on_token) waiting for the worker
        self._running = 0
        self.largest_batch = 0  # the most requests decoded together so far

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                        policy: ImagePolicy | None = None) -> VisionServingEngine:
        from transformers import AutoModelForImageTextToText

        from tokenmill.engines.local.vision import VisionEngine, VisionProcessor

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
        processor = VisionProcessor.from_pretrained(path)
        return cls(VisionEngine(model, processor.tokenizer, seed=seed), processor, policy=policy)

    @property
    def version(self) -> int:
        return self.engine.version

    def update_weights(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:  # never between two decoding steps of a request
            return self.engine.update_weights(*args, **kwargs)

    def score_ranked(self, sequences: list[list[int]], top_k: int = 0) -> list[tuple[Any, tuple[int, ...]]]:
        """Text prompts' logprobs (`prompt_logprobs`; the weight-sync probe), between requests."""
        from tokenmill.engines.local.hf import HFEngine

        with self._lock:
            return HFEngine.score_ranked(self.engine, sequences, top_k)

    def stats(self) -> dict[str, int]:
        return {"running_rows": self._running, "waiting_requests": len(self._pending)}

    def submit(self, prompt_ids: list[int], params: SamplingParams, *, seed: int | None = None, on_token=None,
               images: ImageInputs | None = None) -> RequestFuture:
        from tokenmill.engines.local.vision_batch import VisionRequest

        if self._closed:
            raise EngineUnavailable("the engine is closed")
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        future = RequestFuture()
        generator = None if seed is None else torch.Generator(device=self.engine.device).manual_seed(int(seed))
        self._pending.append((future, VisionRequest([int(t) for t in prompt_ids], params, images, generator),
                              on_token))
        self._pool.submit(self._run)
        return future

    def _take(self) -> list[tuple[RequestFuture, Any, Any]]:
        """The waiting requests still wanted (at most `max_batch_requests`), now running."""
        taken = []
        while self._pending and len(taken) < self.max_batch_requests:
            future, request, on_token = self._pending.popleft()
            if not future.abort_requested and future.set_running_or_notify_cancel():
                taken.append((future, request, on_token))
        return taken

    def _run(self) -> None:
        """Decode every request waiting now as one batch (a later `_run` finds none left and returns)."""
        from tokenmill.engines.local.vision_batch import decode_together

        with self._lock:  # weights are never swapped between two decoding steps
            taken = self._take()
            if not taken:
                return
            self.largest_batch = max(self.largest_batch, len(taken))
            self._running = sum(request.params.n for _, request, _ in taken)
            try:
                groups = decode_together(self.engine, [request for _, request, _ in taken])
            except BaseException as exc:  # noqa: BLE001 - each request's caller gets it
                for future, _, _ in taken:
                    future.set_exception(exc)
                return
            finally:
                self._running = 0
            for (future, _, on_token), group in zip(taken, groups, strict=True):
                future.policy_version = self.engine.version
                try:
                    for row, c in enumerate(group if on_token is not None else ()):
                        for t, lp in zip(c.token_ids, c.logprobs, strict=True):
                            on_token(row, t, lp)
                    future.set_result(group)
                except BaseException as exc:  # noqa: BLE001 - a streaming callback's failure is its request's
                    future.set_exception(exc)

    def cancel(self, future: RequestFuture) -> None:
        future.abort_requested = True
        future.cancel()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
