"""The single-turn Generator: prompts -> engine -> rewards -> Groups of Samples.

Prompts are plain strings (tokenised as they are) or chat messages (rendered with the tokenizer's chat
template and a generation prompt). Each sample keeps the exact token ids the engine produced.
"""

from __future__ import annotations

from typing import Any

from tokenmill.engines.base import InferenceEngine
from tokenmill.rewards.set import RewardSet
from tokenmill.tracking.stages import stage
from tokenmill.types import Completion, Group, Sample, SamplingParams


def encode_prompt(tokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list):
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)
    raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def encode_prompts(tokenizer, prompts: list[Any]) -> list[list[int]]:
    """`encode_prompt` for many prompts; plain strings go through the tokenizer in one batched call."""
    if prompts and all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tokenizer(prompts)["input_ids"]]
    return [encode_prompt(tokenizer, p) for p in prompts]


class Generator:
    """Single-turn rollouts: `params.n` completions per row from `engine`, scored by `rewards`."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer,
        rewards: RewardSet,
        params: SamplingParams,
        prompt_column: str = "prompt",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.params = params
        self.prompt_column = prompt_column

    def rollout(
        self, rows: list[dict[str, Any]], version: int, first_group: int = 0
    ) -> tuple[list[Group], dict[str, float]]:
        """Sample then score (the `Rollout` protocol), timed as the generate and reward stages."""
        with stage("generate") as t:
            prompt_ids, completions = self.sample(rows)
            if t is not None:
                t.add_tokens("generate", sum(len(c.token_ids) for g in completions for c in g))
        with stage("reward"):
            return self.score(rows, prompt_ids, completions, version=version, first_group=first_group), {}

    def sample(
        self, rows: list[dict[str, Any]], params: SamplingParams | None = None
    ) -> tuple[list[list[int]], list[list[Completion]]]:
        """The prompt token ids and `params.n` completions for each row."""
        prompt_ids = encode_prompts(self.tokenizer, [r[self.prompt_column] for r in rows])
        return prompt_ids, self.engine.generate(prompt_ids, params or self.params)

    def score(
        self,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        completions: list[list[Completion]],
        version: int,
        first_group: int = 0,
    ) -> list[Group]:
        """Run every reward on every completion and assemble one Group per row."""
        # like TRL, the prompt and a reference `completion` column are not passed as reward columns
        skip = {self.prompt_column, "completion", "completion_ids"}
        prompts, texts, columns = [], [], {k: [] for k in rows[0] if k not in skip} if rows else {}
        for row, group in zip(rows, completions, strict=True):
            for c in group:
                prompts.append(row[self.prompt_column])
                texts.append(c.text)
                for k, values in columns.items():
                    values.append(row[k])
        sampled = [list(c.token_ids) for group in completions for c in group]  # TRL's completion_ids
        group_ids = [g for g, group in enumerate(completions) for _ in group]  # a failed score is imputed per group
        totals, details = self.rewards.score(prompts, texts, columns, completion_ids=sampled, step=version,
                                             group_ids=group_ids)
        groups, k = [], 0
        for g, (row, ids, group) in enumerate(zip(rows, prompt_ids, completions, strict=True)):
            samples = []
            for c in group:
                detail = details[k]
                samples.append(
                    Sample(
                        tokens=tuple(ids) + c.token_ids,
                        loss_mask=(0,) * len(ids) + (1,) * len(c.token_ids),
                        logprobs=(0.0,) * len(ids) + c.logprobs,
                        prompt_len=len(ids),
                        prompt=row[self.prompt_column],
                        completion=c.text,
                        stop_reason=c.stop_reason,
                        version=version,
                        group_id=first_group + g,
                        reward=totals[k],
                        rewards={name: r.value for name, r in detail.items()},
                        reward_errors={name: r.error for name, r in detail.items() if r.error},
                        row=row,
                        extras={k: v for r in detail.values() if r.extra for k, v in r.extra.items()},
                        routes=c.routes,
                    )
                )
                k += 1
            groups.append(Group(first_group + g, tuple(samples)))
        return groups


def build_generator(cfg: Any, engine: InferenceEngine, tokenizer: Any, rewards: RewardSet) -> Generator:
    """The run's single-turn generator for an `RLConfig`: its sampling params and prompt column (with images,
    for an engine that takes them: `rollout.vision`)."""
    if getattr(engine, "takes_images", False):
        from tokenmill.rollout.vision import build_vision_generator

        return build_vision_generator(cfg, engine, tokenizer, rewards)
    return Generator(engine, tokenizer, rewards, SamplingParams.from_config(cfg.generation), cfg.data.prompt_column)
