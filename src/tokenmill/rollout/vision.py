"""Single-turn rollouts with images: the `Generator` whose prompts carry pictures.

Each row's prompt and images (`data.images`: TRL's `images` column, OpenAI `image_url` parts, PIL images) go
through the model's processor once (`engines.local.vision.VisionProcessor`); the engine encodes the images once
per prompt and samples the group from it; every sample keeps its prompt's `ImageInputs`, which the trainer
reads back (`training.vision`). A row whose image is missing, unreadable, remote (not allowed) or too large
fails on its own: its samples are `StopReason.ERROR` (never trained) and an `image_error` line in
`events.jsonl` names the row (its place among the rows drawn for the step) and the file; the rest of the batch
goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.data.images import DEFAULT_POLICY, ImageError, ImagePolicy, has_images, printable, row_images
from tokenmill.engines.local.vision import VisionProcessor, is_vision_config
from tokenmill.rewards.set import RewardSet
from tokenmill.rollout.generator import Generator
from tokenmill.tracking import events
from tokenmill.types import Completion, ConfigError, Group, ImageInputs, SamplingParams, StopReason

log = logging.getLogger(__name__)


class ImagePrompt(list):
    """A prompt's token ids (a list, as every prompt is) with its images beside them."""

    images: ImageInputs | None = None
    error: str | None = None
    messages: list[dict[str, Any]] | None = None  # the chat messages, image slots `{"type": "image"}` (a remote engine's)


def encode_image_prompt(processor: VisionProcessor, row: dict[str, Any], prompt_column: str, image_column: str,
                        policy: ImagePolicy, where: str) -> ImagePrompt:
    """A row's prompt ids and images; on a bad image, an empty prompt whose `error` says why (and an event)."""
    try:
        messages, images, sources = row_images(row, prompt_column, image_column, policy, where)
        ids, inputs = processor.encode(messages, images, sources)
    except (ImageError, ValueError) as exc:
        prompt = ImagePrompt()
        prompt.error = str(exc)
        events.emit("image_error", reason=prompt.error)
        log.warning("%s (the row's samples fail; the batch goes on)", prompt.error)
        return prompt
    prompt = ImagePrompt(ids)
    prompt.images, prompt.messages = inputs, messages
    return prompt


class VisionGenerator(Generator):
    """`Generator` for a vision-language policy: prompts with images, sampled by a `VisionEngine`."""

    def __init__(self, engine, processor: VisionProcessor, rewards: RewardSet, params: SamplingParams,
                 prompt_column: str = "prompt", image_column: str = "images",
                 policy: ImagePolicy = DEFAULT_POLICY) -> None:
        super().__init__(engine, processor.tokenizer, rewards, params, prompt_column)
        self.processor = processor
        self.image_column = image_column
        self.policy = policy

    def sample(self, rows: list[dict[str, Any]], params: SamplingParams | None = None):
        params = params or self.params
        prompts = [encode_image_prompt(self.processor, row, self.prompt_column, self.image_column, self.policy,
                                       f"row {i} of {len(rows)} drawn") for i, row in enumerate(rows)]
        ok = [i for i, p in enumerate(prompts) if p.error is None]
        sampled = self.engine.generate([prompts[i] for i in ok], params, images=[prompts[i].images for i in ok])
        completions: list[list[Completion]] = [
            [Completion((), (), StopReason.ERROR, "")] * params.n for _ in prompts]
        for i, group in zip(ok, sampled, strict=True):
            completions[i] = group
        return prompts, completions

    def score(self, rows, prompt_ids, completions, version: int, first_group: int = 0) -> list[Group]:
        groups = super().score(rows, prompt_ids, completions, version=version, first_group=first_group)
        out = []
        for group, prompt in zip(groups, prompt_ids, strict=True):
            images = getattr(prompt, "images", None)
            error = getattr(prompt, "error", None)
            samples = tuple(s.with_(images=images, prompt=printable(s.prompt), reward=float("nan") if error else s.reward,
                                    reward_errors={"image": error} if error else s.reward_errors)
                            for s in group.samples)
            out.append(Group(group.group_id, samples))
        return out


def build_vision_generator(cfg: Any, engine, tokenizer: Any, rewards: RewardSet) -> VisionGenerator:
    """The run's generator for a vision-language policy (`rollout.generator.build_generator` picks it)."""
    processor = VisionProcessor.from_pretrained(cfg.model.path, tokenizer=tokenizer)
    return VisionGenerator(engine, processor, rewards, SamplingParams.from_config(cfg.generation),
                           cfg.data.prompt_column, cfg.data.image_column, ImagePolicy.from_config(cfg.data))


def check_images_fit(cfg: Any, model: Any, rows: Any) -> None:
    """Refuse prompts with images for a text model, naming the fields (the first row tells)."""
    if is_vision_config(model.config) or rows is None or not len(rows) or not isinstance(rows[0], dict):
        return
    if has_images(rows[0], cfg.data.prompt_column, cfg.data.image_column):
        raise ConfigError(f"model.path: the prompts have images (data.image_column {cfg.data.image_column!r} or "
                          f"image parts) but {cfg.model.path!r} is a text model; use a vision-language model "
                          "(Qwen2.5-VL, Qwen2-VL, Qwen3-VL)")
