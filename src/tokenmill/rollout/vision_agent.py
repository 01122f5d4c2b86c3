"""Multi-turn episodes whose messages carry images: a screenshot-like observation goes the prompt's way.

An environment returns images the ways a prompt may hold them (`data.images`: an `{"type": "image", "image":
PIL}` part, an `image_url` part with a path or data URL); `ImageEnv` wraps it, reads each new image once and
hands the agent loop messages whose image parts are plain `{"type": "image"}` slots. `VisionAgentLoop` is the
agent loop with two additions to its token truth: every image slot the chat template renders (in the reset
messages or in an observation) becomes as many image tokens as the image's grid makes, and the episode's
images travel with its tokens, so the engine encodes them with the history and the trainer reads the same
pictures at the same places (`training.vision`). Sampled tokens are kept as sampled, never re-tokenized.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenmill.data.images import DEFAULT_POLICY, ImagePolicy, load_image, split_images
from tokenmill.engines.local.vision import VisionProcessor
from tokenmill.envs.base import StepResult, as_messages, as_step_result, call
from tokenmill.rollout.agent import AgentEpisode, AgentLoop
from tokenmill.rollout.vision import ImagePrompt
from tokenmill.types import Completion, ImageInputs, Sample, StopReason

log = logging.getLogger(__name__)


class ImageEnv:
    """An environment whose image parts are read into PIL images (`images`, in the order they appeared)."""

    def __init__(self, env: Any, policy: ImagePolicy = DEFAULT_POLICY) -> None:
        self.env = env
        self.policy = policy
        self.images: list[Any] = []
        self.sources: list[str] = []
        if hasattr(env, "tools"):
            self.tools = env.tools

    def _read(self, messages: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
        messages, refs = split_images(messages)
        for i, ref in enumerate(refs):
            self.images.append(load_image(ref, self.policy, f"{what} image {i}"))
            self.sources.append(what)
        return messages

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return self._read(as_messages(await call(self.env.reset, task)), "reset")

    async def step(self, message: dict[str, Any]) -> StepResult:
        result = as_step_result(await call(self.env.step, message))
        return StepResult(self._read(list(result.observation), "observation"), result.reward, result.done, result.info)

    async def close(self) -> None:
        if hasattr(self.env, "close"):
            await call(self.env.close)


def merged(parts: list[ImageInputs]) -> ImageInputs | None:
    """One `ImageInputs` holding every part's images in order (None for none)."""
    if not parts:
        return None
    return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts]),
                       tuple(s for p in parts for s in p.sources), tuple(x for p in parts for x in p.pictures))


class VisionAgentLoop(AgentLoop):
    """`AgentLoop` for a vision-language policy: environments may show images in resets and observations."""

    def __init__(self, engine: Any, processor: VisionProcessor, env_factory, params, limits=None, *,
                 policy: ImagePolicy = DEFAULT_POLICY, **kwargs: Any) -> None:
        super().__init__(engine, processor.tokenizer, lambda: ImageEnv(env_factory(), policy), params,
                         **({"limits": limits} if limits is not None else {}), **kwargs)
        self.processor = processor
        self._parts: dict[int, list[ImageInputs]] = {}  # episode index -> its images, one part per message batch

    def _expand(self, ep: AgentEpisode, start: int) -> None:
        """Give the images the environment showed since the last call their image tokens: each slot (one image
        token after vision-start) in `ep.tokens[start:]` becomes the image's count; the mask and logprobs
        follow (0: environment tokens)."""
        env = ep.env
        parts = self._parts.setdefault(ep.index, [])
        seen = sum(p.num_images for p in parts)
        new = env.images[seen:] if isinstance(env, ImageEnv) else []
        tokens = list(ep.tokens)
        if new:
            inputs = self.processor.pixels(new, tuple(env.sources[seen:]))
            parts.append(inputs)
            counts = iter((inputs.image_grid_thw.prod(-1) // self.processor.merge**2).tolist())
            image_id, opener = self.processor.image_token_id, self.processor.vision_start_id
            tail = []
            for k in range(start, len(tokens)):
                slot = tokens[k] == image_id and tokens[k - 1] == opener
                tail += [image_id] * next(counts) if slot else [tokens[k]]
            tokens = tokens[:start] + tail
        ep.tokens = ImagePrompt(tokens)
        ep.tokens.images = merged(parts)
        grown = len(tokens) - len(ep.mask)
        ep.mask += [0] * grown
        ep.logprobs += [0.0] * grown

    async def _start(self, ep: AgentEpisode) -> None:
        await super()._start(ep)
        if ep.error is None and ep.env is not None:
            ep.mask, ep.logprobs = [], []
            self._expand(ep, 0)
            ep.prompt_len = len(ep.tokens)
            if ep.prompt_len >= self.limits.max_episode_tokens:
                ep.done, ep.stop = True, StopReason.LENGTH

    async def _step(self, ep: AgentEpisode, turn: Completion) -> None:
        start = len(ep.tokens) + len(turn.token_ids)
        await super()._step(ep, turn)
        if ep.error is None and len(ep.tokens) > start:  # an observation came: its images get their tokens
            self._expand(ep, start)
            if len(ep.tokens) >= self.limits.max_episode_tokens:
                ep.done, ep.stop = True, StopReason.LENGTH
                ep.info["token_limit"] = True

    def to_sample(self, ep: AgentEpisode, version: int, first_group: int = 0) -> Sample:
        return super().to_sample(ep, version, first_group).with_(images=merged(self._parts.pop(ep.index, [])))


def build_vision_agent(cfg: Any, engine: Any, processor: VisionProcessor, factory, limits, **kwargs: Any):
    """The agent loop of a vision-language run (`rollout.agent.build_agent` picks it for an engine that takes
    images)."""
    from tokenmill.types import SamplingParams

    return VisionAgentLoop(engine, processor, factory, SamplingParams.from_config(cfg.generation), limits,
                           policy=ImagePolicy.from_config(cfg.data), **kwargs)
