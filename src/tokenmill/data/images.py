"""Prompts with images: the formats users have, read into PIL images and chat messages with image slots.

Three forms are accepted, the same ones TRL, the OpenAI API and `datasets` use:

- TRL's vision-language datasets: a conversational `prompt` beside an `images` column (a list of images, or
  one image). Messages whose content has `{"type": "image"}` parts take the images in order; where the prompt
  has no such part, the images go at the start of the first user message (as TRL puts them).
- OpenAI-style content parts: `{"type": "image_url", "image_url": {"url": ...}}` with a file path, a
  `file://` URL or a `data:image/...;base64,...` URL. A remote `http(s)://` URL is refused unless the config
  allows it (`data.allow_remote_images: true`), so a run never fetches from the network without being asked.
- PIL images (or `datasets.Image` values: `{"bytes", "path"}`) in the column, or in an `{"type": "image",
  "image": ...}` part.

A missing, unreadable or oversized image raises `ImageError` naming the row and the file; the rollout turns it
into a failed sample of its own (`rollout.vision`), never a failed batch.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.types import ConfigError, TokenmillError

DEFAULT_MAX_PIXELS = 4096 * 4096  # an image's width x height above this is refused (a decompression bomb guard)
REMOTE_TIMEOUT_S = 10.0


class ImageError(TokenmillError):
    """One row's image cannot be used; the message names the row and the image."""


@dataclass(frozen=True)
class ImagePolicy:
    """What an image may be: remote URLs allowed or not, the largest width x height accepted."""

    allow_remote: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def from_config(cls, data: Any) -> ImagePolicy:
        """From a `data:` config section (`DataConfig`)."""
        return cls(allow_remote=data.allow_remote_images, max_pixels=data.max_image_pixels)


DEFAULT_POLICY = ImagePolicy()  # local images only, up to DEFAULT_MAX_PIXELS


def pil():
    """The PIL.Image module, or one line naming the extra to install."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("images need Pillow (pip install 'tokenmill[vision]')") from None
    return Image


def describe(ref: Any) -> str:
    """A short name for an image reference, for messages: the path, a URL's start, or the object's type."""
    if isinstance(ref, str):
        return repr(ref[:40] + "...") if ref.startswith("data:") else repr(ref)
    if isinstance(ref, dict) and ref.get("path"):
        return repr(ref["path"])
    return type(ref).__name__


def _open(ref: Any, policy: ImagePolicy):
    Image = pil()
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):  # a datasets.Image value, not decoded
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref))
    if not isinstance(ref, str):
        raise TypeError(f"not an image: a {type(ref).__name__} (a path, a data or file URL, or a PIL image)")
    if ref.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data URL must be base64 (data:image/png;base64,...)")
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    if ref.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise ValueError("a remote image URL; set data.allow_remote_images: true to fetch it")
        import urllib.request

        with urllib.request.urlopen(ref, timeout=REMOTE_TIMEOUT_S) as response:  # the user allowed it
            return Image.open(io.BytesIO(response.read()))
    path = Path(ref.removeprefix("file://"))
    if not path.is_file():
        raise ValueError("no such file")
    return Image.open(path)


def load_image(ref: Any, policy: ImagePolicy = DEFAULT_POLICY, where: str = "") -> Any:
    """An RGB PIL image from a reference (a PIL image, a path, a `file://` or `data:` URL, an allowed remote URL,
    bytes or a `datasets.Image` value); `ImageError` naming `where` and the image when it cannot be used."""
    try:
        image = _open(ref, policy)
        width, height = image.size  # read from the header: an oversized image is refused before it is decoded
        if width * height > policy.max_pixels:
            raise ValueError(f"{width}x{height} pixels is more than data.max_image_pixels ({policy.max_pixels})")
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever PIL or the file system says becomes the sample's reason
        raise ImageError(f"{where + ': ' if where else ''}image {describe(ref)}: {exc}") from None


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [dict(p) if isinstance(p, dict) else {"type": "text", "text": str(p)} for p in content]
    return [{"type": "text", "text": "" if content is None else str(content)}]


def split_images(messages: Sequence[dict[str, Any]], column: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages whose image parts are all `{"type": "image"}`, the image references in the order they appear).

    `column`: the row's images column (TRL's `images`: a list, or one image), taken by the `{"type": "image"}`
    parts without an image of their own, in order; images left over go at the start of the first user message.
    `image_url` parts (OpenAI) and `{"type": "image", "image": ...}` parts bring their own reference.
    """
    pending = list(column) if isinstance(column, (list, tuple)) else ([] if column is None else [column])
    refs: list[Any] = []
    out = []
    for message in messages:
        parts = _parts(message.get("content"))
        for part in parts:
            kind = part.get("type")
            if kind == "image_url":
                url = part.get("image_url")
                refs.append(url.get("url") if isinstance(url, dict) else url)
                part.clear()
                part["type"] = "image"
            elif kind == "image":
                own = part.pop("image", None) or part.pop("url", None) or part.pop("path", None)
                if own is None and not pending:
                    raise ImageError(f"message {len(out)}: an image part with no image (the images column has "
                                     "too few)")
                refs.append(own if own is not None else pending.pop(0))
        out.append({**message, "content": parts})
    if pending and refs:
        raise ImageError(f"the images column has {len(refs) + len(pending)} images for {len(refs)} image parts")
    if pending:
        first = next((m for m in out if m.get("role") == "user"), None)
        if first is None:
            raise ImageError("the images column has images but the prompt has no user message to put them in")
        first["content"] = [{"type": "image"} for _ in pending] + first["content"]
        refs = pending
    return out, refs


def has_images(row: dict[str, Any], prompt_column: str, image_column: str) -> bool:
    """Whether a row's prompt carries images (an images column value, or image parts in its messages)."""
    if row.get(image_column) not in (None, [], ()):
        return True
    prompt = row.get(prompt_column)
    if not isinstance(prompt, list):
        return False
    return any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
               for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"])


def row_images(row: dict[str, Any], prompt_column: str, image_column: str, policy: ImagePolicy,
               where: str = "") -> tuple[list[dict[str, Any]], list[Any], tuple[str, ...]]:
    """(the prompt as messages with image slots, its images as RGB PIL images, where each came from) of one row.
    A string prompt with images becomes one user message. `ImageError` names `where` (e.g. "row 3")."""
    prompt = row[prompt_column]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    try:
        messages, refs = split_images(messages, row.get(image_column))
    except ImageError as exc:
        raise ImageError(f"{where + ': ' if where else ''}{exc}") from None
    images = [load_image(ref, policy, where) for ref in refs]
    return messages, images, tuple(describe(ref) for ref in refs)


def printable(prompt: Any) -> Any:
    """A prompt as logs keep it: image parts name their image (`describe`) instead of holding pixels or a whole
    data URL, so `samples.jsonl` stays JSON and small."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                ref = part.get("image_url") or part.get("image") or part.get("url") or part.get("path")
                ref = ref.get("url") if isinstance(ref, dict) else ref
                parts.append({"type": "image", "image": describe(ref)} if ref is not None else {"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out
