"""`rewards:` entries: a function (TRL's reward signature), a reward model, a builtin (math_verify) or an LLM
judge (config/judge.py), one discriminated union (`RewardConfig`) that `RLConfig.rewards` is a list of."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from tokenmill.config.judge import RewardJudgeConfig
from tokenmill.config.section import Section

__all__ = ["RewardBuiltinConfig", "RewardConfig", "RewardFunctionConfig", "RewardJudgeConfig", "RewardModelConfig"]


class RewardFunctionConfig(Section):
    type: Literal["function"] = "function"
    name: str | None = Field(None, description="Name used in metrics; defaults to the function's name.")
    function: str = Field(
        ..., description="Import string 'module:attr' or 'path/to/file.py:attr' of a reward function, called "
        "as TRL's GRPOTrainer calls it: fn(prompts=, completions=, completion_ids=, <columns>=, trainer_state=)."
    )
    weight: float = Field(1.0, description="Weight in the total reward.")
    timeout_s: float = Field(10.0, gt=0, description="Seconds one batched call may take before it fails.")
    per_sample: bool = Field(
        False, description="The function scores one sample: fn(prompt, completion, **row) -> float."
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="process: run in a forked worker that is killed on timeout; thread: in this process "
        "(needed if the function uses torch; a hung call is abandoned, not killed).",
    )


class RewardModelConfig(Section):
    type: Literal["model"] = "model"
    name: str | None = Field(None, description="Name used in metrics; defaults to the folder's name.")
    path: str = Field(..., description="Folder of an AutoModelForSequenceClassification with one label.")
    weight: float = Field(1.0, description="Weight in the total reward.")
    batch_size: int = Field(32, ge=1, description="Sequences scored per forward pass.")


class RewardBuiltinConfig(Section):
    """A reward shipped with tokenmill (`tokenmill.rewards.builtin`): `{builtin: math_verify}`."""

    type: Literal["builtin"] = "builtin"
    builtin: Literal["math_verify"] = Field(
        ..., description="math_verify: the completion's answer (LaTeX, \\boxed{}, plain) equals the row's `column` "
        "by math-verify (needs tokenmill[tasks])."
    )
    name: str | None = Field(None, description="Name used in metrics; defaults to the builtin's name.")
    column: str = Field("answer", min_length=1, description="Dataset column holding the reference answer.")
    weight: float = Field(1.0, description="Weight in the total reward.")
    timeout_s: int = Field(5, ge=1, le=300, description="math-verify's own limit per sample, in whole seconds, for "
                           "parsing and for verifying: a pathological expression scores 0, the batch goes on.")
    batch_timeout_s: float = Field(120.0, gt=0, description="Seconds one batched call may take before it fails.")


def _reward_kind(value: object) -> str:
    if isinstance(value, dict):  # `type` may be left out: `builtin`, or a `path` and no `function` (a model)
        if "type" in value:
            return str(value["type"])
        if "builtin" in value:
            return "builtin"
        return "model" if "path" in value and "function" not in value else "function"
    return str(getattr(value, "type", "function"))


RewardConfig = Annotated[
    Annotated[RewardFunctionConfig, Tag("function")] | Annotated[RewardModelConfig, Tag("model")]
    | Annotated[RewardJudgeConfig, Tag("judge")]
    | Annotated[RewardBuiltinConfig, Tag("builtin")],
    Discriminator(_reward_kind),
]
