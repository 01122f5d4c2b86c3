"""`record:`: dump every step's rollouts to Parquet, train from such a dump, or roll out without training.

    record:
      rollouts: true        # write <output_dir>/rollouts/*.parquet (or `dir`)
      every: 10             # steps per shard
      replay: null          # a dump folder: train on its rollouts, no engine is built
      rollout_only: false   # generate and score (and dump), never train
"""

from __future__ import annotations

from pydantic import Field, model_validator

from tokenmill.config.section import Section


class RecordConfig(Section):
    """Rollout record and replay (docs/replay.md)."""

    rollouts: bool = Field(False, description="Dump each step's scored rollouts (token ids, logprobs, masks, "
                           "rewards, versions, prompts and completions) to Parquet shards.")
    dir: str | None = Field(None, description="Folder of the dump; default <tracking.output_dir>/rollouts.")
    every: int = Field(10, ge=1, le=100_000, description="Steps per Parquet shard (each written atomically).")
    replay: str | None = Field(None, description="A dump folder: train on its rollouts, step by step, instead "
                               "of generating (no engine is built; held-out evaluation is off).")
    rollout_only: bool = Field(False, description="Generate and score without training (dumps and metrics only); "
                               "turns `rollouts` on.")

    @model_validator(mode="after")
    def _consistent(self) -> RecordConfig:
        if self.replay is not None and self.rollout_only:
            raise ValueError("record.rollout_only: a replay trains on recorded rollouts; it cannot also only roll out")
        if self.rollout_only and not self.rollouts:
            self.rollouts = True
        return self
