"""A real engine sampling at another temperature than the run's config says: the most common way an engine's
logprobs drift from the trainer's (a server started with its own default, a client that drops the field). The
tokens and logprobs are the wrapped engine's own, sampled at `temperature`; only the request's temperature
is changed, so `mismatch/*` sees what it would see in such a run."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.types import Completion, SamplingParams


class TemperatureShifted:
    """`engine`, asked for `temperature` whatever a request says; everything else passes through."""

    def __init__(self, engine: Any, temperature: float) -> None:
        self.engine, self.temperature = engine, temperature

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, replace(params, temperature=self.temperature))

    def __getattr__(self, name: str) -> Any:  # version, pad_id, update_weights, score, ...
        return getattr(self.engine, name)


def shift_temperature(run: Any, temperature: float) -> TemperatureShifted:
    """Make a built colocated `run` (`controller.build_run`) sample at `temperature`; returns the engine."""
    shifted = TemperatureShifted(run.engine, temperature)
    run.generator.engine = shifted
    return shifted
