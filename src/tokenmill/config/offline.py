"""The offline modes' configs: supervised fine-tuning (`SFTConfig`) and preference pairs (`PreferenceConfig`, DPO
/ IPO / SimPO or a Bradley-Terry reward model).

Both are an `OptimConfig` (the optimiser fields RL reads under `training:`, here at the top level, each mode with
its own defaults) plus `OfflineConfig` (the model, where it is written, steps and batch size) plus their data.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tokenmill.config.schema import DataConfig, ModelConfig, OptimConfig
from tokenmill.config.section import Section


class OfflineConfig(Section):
    """What every offline run has: a policy, an output folder, a number of steps and a batch size."""

    model: ModelConfig
    output_dir: str = Field("runs/offline", description="Where the trained model folder is written.")
    steps: int = Field(200, ge=1, description="Optimiser steps.")
    batch_size: int = Field(32, ge=1, description="Sequences (SFT) or pairs (preference) per optimiser step.")


class SFTConfig(OptimConfig, OfflineConfig):
    """Supervised fine-tuning (used for warm starts): prompt -> completion pairs, conversations or plain text."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"output_dir": "runs/sft", "steps": 300, "batch_size": 64,
                                          "learning_rate": 1e-3, "warmup_steps": 20, "lr_schedule": "cosine"}

    data: DataConfig
    completion_column: str = Field("completion", description="Column with the target completion text.")
    messages_column: str | None = Field(
        None, description="Column of chat conversations (lists of {role, content}) rendered with the tokenizer's "
        "chat template; the loss then covers the assistant messages only (prompt/completion columns unused). "
        "Unset, a `messages` (or `text`) column serves when the prompt / completion columns are absent."
    )
    packing: bool = Field(
        False, description="Pack sequences side by side into rows of up to micro_batch_tokens tokens "
        "(block-diagonal attention, positions restarting per sequence): no compute spent on padding."
    )
    micro_batch_tokens: int = Field(8192, ge=16, description="Token budget of one micro-batch (and packed row).")

    @model_validator(mode="after")
    def _data_source(self) -> SFTConfig:
        if self.data.task is None and self.data.path is None:  # DataConfig leaves "neither" to its run's config
            raise ValueError("data: set exactly one of data.task or data.path")
        return self


class PreferenceDataConfig(Section):
    task: Literal["addition"] | None = Field(
        None, description="Built-in synthetic preference task: 'addition' (the true sum chosen over a slip)."
    )
    path: str | None = Field(
        None, description="Pairs with prompt / chosen / rejected columns (or chosen / rejected, the prompt their common "
        "start; strings or message lists): a json/jsonl/parquet/csv file or folder."
    )
    split: str = Field("train", description="Split to read when `path` is a dataset name or folder.")
    num_train: int = Field(5000, ge=1, description="Pairs generated for the built-in task.")
    num_eval: int = Field(400, ge=0, description="Held-out pairs (built-in task) for the final report.")
    image_column: str = Field(
        "images", description="Column of each pair's prompt images for a vision-language policy (TRL's vision "
        "preference format: `images` beside prompt / chosen / rejected); image parts in the prompt work too."
    )

    @model_validator(mode="after")
    def _one_source(self) -> PreferenceDataConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError("set exactly one of data.task or data.path")
        return self


class PreferenceConfig(OptimConfig, OfflineConfig):
    """Offline preference training (DPO / IPO / SimPO) or a Bradley-Terry reward model, on pairs."""

    DEFAULTS: ClassVar[dict[str, Any]] = {"output_dir": "runs/preference", "learning_rate": 2e-5,
                                          "warmup_steps": 10, "lr_schedule": "cosine"}

    data: PreferenceDataConfig
    objective: Literal["dpo", "ipo", "simpo", "reward_model"] = Field(
        "dpo", description="dpo / ipo (frozen reference), simpo (no reference), or reward_model (Bradley-Terry "
        "on a one-label sequence classifier that an RL config's rewards can load)."
    )
    beta: float = Field(0.1, gt=0.0, description="DPO / IPO / SimPO temperature.")
