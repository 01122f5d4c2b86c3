"""`health:`: how often a run checks that it can learn (rollout-trainer mismatch, the weight-sync probe).

    health:
      mismatch_every: 1       # engine vs trainer logprobs of the sampled tokens, every step
      probe_every: 1          # after every push the engine scores a fixed sequence
      probe_tolerance: null   # null: by dtype (fp32 1e-4, bf16/fp16 looser)
      probe_tokens: 32
"""

from __future__ import annotations

from pydantic import Field

from tokenmill.config.section import Section


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
