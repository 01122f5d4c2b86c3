"""Shared data of tokenmill: plain frozen records that flow between components.

A `Sample` is token-level truth: one token sequence (prompt + completion) with an aligned loss mask and
the sampler's logprob of every token. Text is derived from tokens, never the other way round. Padding
and tensors appear only in `Batch` (see `training/batch.py`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any


class StopReason(str, enum.Enum):
    """Why a completion ended; errors are data, counted in metrics, never crashes."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # hit max_tokens
    ERROR = "error"  # the engine failed for this request
    ABORT = "abort"  # cut short on purpose (weight update with interruption, cancel): tokens so far


class TokenmillError(Exception):
    """Base class of errors that tokenmill reports to the user with a readable message."""


class ConfigError(TokenmillError):
    """A configuration value is invalid; the message names the dotted field path."""


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. `n` completions are drawn for each prompt (a GRPO group)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    greedy: bool = False

    @classmethod
    def from_config(cls, generation: Any) -> SamplingParams:
        """From a `generation:` config section (`GenerationConfig`): `n` is its `group_size`."""
        g = generation
        return cls(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                   n=g.group_size, stop=tuple(g.stop))


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request: sampled token ids and their logprobs.

    routes: where the engine records a mixture-of-experts model's routing (`engines.local.routing`), the
            expert indices of the prompt's tokens then the sampled ones: an int16 tensor `[T, layers x top_k]`
            (-1: not recorded, e.g. the last sampled token, which no forward reads); None otherwise
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: StopReason
    text: str = ""
    routes: Any = field(default=None, compare=False)  # torch.Tensor | None


@dataclass(frozen=True)
class PromptLogprobs:
    """An engine's score of one given token sequence `ids` (teacher forcing, nothing sampled).

    token_logprobs:  len(ids) - 1 values: log p(ids[i] | ids[:i]) for i >= 1, under softmax of the raw
                     logits (temperature 1)
    top_logprobs:    per scored position, the k most likely token ids and their logprobs (when asked for
                     top_k > 0); None otherwise
    policy_version:  the version of the weights that scored it, where the engine says (a server's answer)
    """

    token_logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...] | None = None
    policy_version: int | None = None


@dataclass(frozen=True)
class RewardResult:
    """One reward function's score for one sample; `value is None` means abstained or failed. `extra`: what the
    function logged for this sample through TRL's `log_extra(column, values)` (e.g. the answer it extracted)."""

    value: float | None
    error: str | None = None
    extra: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as a vision-language model reads them (the processor's output, computed once per
    prompt and shared by every sample of its group).

    pixel_values:   float tensor `[patches, channels x temporal x patch x patch]`, every image's patches in order
    image_grid_thw: long tensor `[images, 3]`: each image's (temporal, height, width) patch grid
    sources:        where each image came from (a file, a data URL's media type, a column and row), for messages
    pictures:       the RGB images the pixels were made from (what a remote engine sends to its server), or ()
    """

    pixel_values: Any
    image_grid_thw: Any
    sources: tuple[str, ...] = ()
    pictures: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


@dataclass(frozen=True)
class Sample:
    """One trajectory as the trainer sees it.

    tokens:     prompt + completion token ids (length T)
    loss_mask:  1 where the token is trained (policy tokens), 0 for prompt / environment tokens
    logprobs:   sampler logprob of each token (0.0 where loss_mask is 0)
    version:    policy version (optimizer steps taken) that produced the completion
    reward:     weighted total over reward functions; NaN if every function failed (not trained)
    rewards:    each reward function's value by name (None = abstained / failed)
    advantage:  one advantage for the whole sequence (GRPO family)
    token_advantages, returns, values: per-token (aligned with tokens, 0 where not trained), set by GAE
                for PPO with a critic; empty otherwise
    token_versions: the policy version of each completion token when a completion spans weight updates
                (partial rollouts); `version` is then the oldest. Empty: every token is from `version`
    extras:     what the reward functions logged for this sample with `log_extra` (column -> value)
    routes:     a mixture-of-experts policy's expert indices per token as the engine routed it: an int16
                tensor `[T, layers x top_k]` (-1 where not recorded), replayed by the trainer
                (`training.router_replay`); None when not recorded (a tuple of per-token tuples is read too)
    episode:    a step-wise agent sample (`env.stepwise`): one model call of the episode with this number; the
                calls of one episode share its return and its advantage. -1: the sample is a whole trajectory
    images:     the prompt's images as the vision encoder reads them (a vision-language policy); None: text only
    """

    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    prompt: Any
    completion: str
    stop_reason: StopReason
    version: int = 0
    group_id: int = 0
    reward: float = 0.0
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward_errors: dict[str, str] = field(default_factory=dict)
    advantage: float = 0.0
    token_advantages: tuple[float, ...] = ()
    returns: tuple[float, ...] = ()
    values: tuple[float, ...] = ()
    row: dict[str, Any] = field(default_factory=dict)
    token_versions: tuple[int, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict)
    routes: Any = field(default=None, compare=False)  # torch.Tensor | None
    episode: int = -1
    images: ImageInputs | None = field(default=None, compare=False)

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def completion_ids(self) -> tuple[int, ...]:
        return self.tokens[self.prompt_len :]

    @property
    def trainable(self) -> bool:
        return not math.isnan(self.reward) and self.stop_reason is not StopReason.ERROR

    def with_(self, **changes: Any) -> Sample:
        """A copy with `changes` (as `dataclasses.replace`, without re-running `__init__`: a step makes one
        per sample, on the trainer's critical path)."""
        unknown = changes.keys() - _SAMPLE_FIELDS
        if unknown:
            raise TypeError(f"Sample has no field(s) {', '.join(sorted(unknown))}")
        new = object.__new__(Sample)
        new.__dict__.update(self.__dict__, **changes)
        return new


_SAMPLE_FIELDS = frozenset(f.name for f in fields(Sample))


@dataclass(frozen=True)
class Group:
    """The samples drawn for one prompt; GRPO normalises rewards inside a group."""

    group_id: int
    samples: tuple[Sample, ...]

    @property
    def rewards_G(self) -> list[float]:
        return [s.reward for s in self.samples]
