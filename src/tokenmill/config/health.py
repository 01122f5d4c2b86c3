"""`health:`: how often a run checks that it can learn (rollout-trainer mismatch, the weight-sync probe).

    health:
      mismatch_every: 1       # engine vs trainer logprobs of the sampled tokens, every step
      probe_every: 1          # after every push the engine scores a fixed sequence
      probe_tolerance: null   # null: by dtype (fp32 1e-4, bf16/fp16 looser)
      probe_tokens: 32
      alarms:                 # each: policy warn | stop | off, a threshold and a window (steps)
        flat_groups: {policy: warn, threshold: 1.0, window: 5}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokenmill.config.section import Section

Policy = Literal["warn", "stop", "off"]
POLICY = ("warn: a console line and an `alarm` row in events.jsonl, the run goes on; stop: a checkpoint, then "
          "the run exits non-zero with the message; off: not checked.")
WINDOW = "Consecutive steps the condition must hold before the alarm fires."


class Alarm(Section):
    """One alarm: what it does when it fires (`policy`), its `threshold` and its `window` in steps."""

    policy: Policy = Field("warn", description=POLICY)
    threshold: float = Field(1.0, description="The value the watched metric is compared with.")
    window: int = Field(1, ge=1, le=100_000, description=WINDOW)


class FlatGroupsAlarm(Alarm):
    """`groups/zero_variance_fraction` >= threshold (every group scored the same: zero advantage)."""

    threshold: float = Field(1.0, gt=0.0, le=1.0, description="Share of groups whose rewards are all equal.")
    window: int = Field(5, ge=1, le=100_000, description=WINDOW)


class TruncationAlarm(Alarm):
    """`response_len/clip_ratio` >= threshold (completions cut at generation.max_tokens)."""

    threshold: float = Field(0.5, gt=0.0, le=1.0, description="Share of completions stopped by max_tokens.")
    window: int = Field(3, ge=1, le=100_000, description=WINDOW)


class EntropyFloorAlarm(Alarm):
    """`entropy` < threshold (the policy has collapsed onto one answer)."""

    threshold: float = Field(0.01, ge=0.0, description="Mean token entropy (nats) below which the alarm counts.")
    window: int = Field(5, ge=1, le=100_000, description=WINDOW)


class EntropyDropAlarm(Alarm):
    """`entropy` fell by at least `threshold` (a share) over the last `window` steps."""

    threshold: float = Field(0.9, gt=0.0, le=1.0, description="Share of the entropy lost within the window.")
    window: int = Field(20, ge=1, le=100_000, description="Steps the fall is measured over.")


class RewardFailuresAlarm(Alarm):
    """A reward function failed (raised, timed out, returned NaN) on at least `threshold` of the samples it
    scored, for `window` steps in a row; per function."""

    policy: Policy = Field("stop", description=POLICY)
    threshold: float = Field(1.0, gt=0.0, le=1.0, description="Share of a function's samples that failed "
                             "(1.0: every sample; samples it abstained on with None do not count).")
    window: int = Field(3, ge=1, le=100_000, description=WINDOW)


class MismatchAlarm(Alarm):
    """`mismatch/kl` >= threshold (the engine's logprobs disagree with the trainer's)."""

    threshold: float = Field(0.01, gt=0.0, description="KL estimate between engine and trainer, per token.")
    window: int = Field(3, ge=1, le=100_000, description=WINDOW)


class ProbeAlarm(Alarm):
    """`probe/ok` < threshold (the engine did not score the probe like the trainer: the weight sync failed)."""

    policy: Policy = Field("stop", description=POLICY)
    threshold: float = Field(1.0, gt=0.0, le=1.0, description="probe/ok is 1 (passed) or 0 (failed).")
    window: int = Field(1, ge=1, le=100_000, description=WINDOW)


class GradSpikeAlarm(Alarm):
    """`grad_norm` >= threshold x the median grad_norm of the previous `window` steps."""

    threshold: float = Field(10.0, gt=1.0, description="Multiple of the running median.")
    window: int = Field(20, ge=2, le=100_000, description="Steps the running median is taken over.")


class SkippedUpdateAlarm(Alarm):
    """An optimiser step skipped because its gradient was NaN or inf (`skipped_nonfinite` > 0; the trainer never
    applies such an update): each one is an `alarm` event naming the cause; `window` in a row stop the run."""

    policy: Policy = Field("stop", description="stop: after `window` skipped steps in a row the run exits "
                           "non-zero (each skip before is a warning); warn: each skip is a warning, the run goes "
                           "on; off: skipped silently.")
    threshold: float = Field(0.0, ge=0.0, lt=1.0, description="Share of a step's optimiser steps skipped above "
                             "which the step counts (0: any).")
    window: int = Field(3, ge=1, le=100_000, description="Skipped steps in a row that stop the run.")


class RewardPlateauAlarm(Alarm):
    """The mean `reward/mean` of the last `window` steps is not above that of the `window` steps before by more
    than `threshold` (warn only: a plateau can be the end of learning)."""

    policy: Literal["warn", "off"] = Field("warn", description="warn or off (never stops a run).")
    threshold: float = Field(0.0, ge=0.0, description="Least rise of the windowed mean reward.")
    window: int = Field(100, ge=1, le=100_000, description="Steps per window (two windows are compared).")


class AlarmsConfig(Section):
    """Alarms on the step's metrics. An update whose gradient is NaN or inf is skipped by the trainer and
    counted by `skipped_update`; NaN or inf anywhere else (a loss or advantage of an update that was applied)
    always stops the run (no checkpoint of the broken weights is written: the last one is kept)."""

    flat_groups: FlatGroupsAlarm = Field(default_factory=FlatGroupsAlarm, description="All groups flat.")
    truncation: TruncationAlarm = Field(default_factory=TruncationAlarm, description="Completions truncated.")
    entropy_floor: EntropyFloorAlarm = Field(default_factory=EntropyFloorAlarm, description="Entropy too low.")
    entropy_drop: EntropyDropAlarm = Field(default_factory=EntropyDropAlarm, description="Entropy falling fast.")
    reward_failures: RewardFailuresAlarm = Field(default_factory=RewardFailuresAlarm,
                                                 description="A reward function failing.")
    mismatch: MismatchAlarm = Field(default_factory=MismatchAlarm, description="Engine-trainer logprob gap.")
    probe: ProbeAlarm = Field(default_factory=ProbeAlarm, description="Weight-sync probe failed.")
    grad_spike: GradSpikeAlarm = Field(default_factory=GradSpikeAlarm, description="Gradient-norm spike.")
    reward_plateau: RewardPlateauAlarm = Field(default_factory=RewardPlateauAlarm,
                                               description="No reward improvement.")
    skipped_update: SkippedUpdateAlarm = Field(default_factory=SkippedUpdateAlarm,
                                               description="Updates skipped for a NaN or inf gradient.")


class HealthConfig(Section):
    """Run-health checks: the engine-vs-trainer logprob gap and the weight-sync probe."""

    mismatch_every: int = Field(
        1, ge=0, description="Log mismatch/* (engine vs trainer logprobs of the sampled tokens) every N steps; "
        "0 never. Free when algorithm.off_policy recomputes old logprobs, else one no-grad forward.")
    probe_every: int = Field(
        1, ge=0, description="After every N-th weight push the engine scores a fixed probe sequence and it must "
        "match the trainer's logprobs (probe/max_abs, probe/ok); 0 never.")
    probe_tolerance: float | None = Field(
        None, gt=0.0, description="Largest |engine - trainer| logprob the probe accepts; null: by the model's "
        "dtype (float32 1e-4, bfloat16 / float16 looser).")
    probe_tokens: int = Field(32, ge=2, le=4096, description="Length of the fixed probe sequence, in tokens.")
    alarms: AlarmsConfig = Field(default_factory=AlarmsConfig, description="Alarms on the step's "
        "metrics (docs/health.md has each alarm's default and the fix it names).")

