"""Faults that make a run unable to learn, for the health checks' tests (real engines and trainers, one part
changed).

`TemperatureShifted`: a real engine sampling at another temperature than the run's config says, the most
common way an engine's logprobs drift from the trainer's (a server started with its own default, a client
that drops the field). Tokens and logprobs are the wrapped engine's own, sampled at `temperature`; only the
request's temperature is changed, so `mismatch/*` sees what it would see in such a run.

`DroppedPushes`: a weight sync whose pushes of the given versions silently do nothing (the server keeps its
old weights and says nothing), around the real sync for every other version: the weight-sync probe's case.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.sync.base import NamedTensors
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
    shifted = TemperatureShifted(run.rollout.engine, temperature)
    run.rollout.evaluator.engine = shifted  # the generator: the colocated actor and the evaluator
    return shifted


class DroppedPushes:
    """A `WeightSync` that passes pushes to `sync` except those of `versions`, which it drops silently."""

    def __init__(self, sync: Any, versions: set[int]) -> None:
        self.sync, self.versions, self.dropped = sync, set(versions), []

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        if version in self.versions:
            self.dropped.append(version)
            return
        self.sync.push(named_tensors, version)

    def close(self) -> None:
        self.sync.close()


def drop_pushes(monkeypatch: Any, versions: set[int]) -> list[DroppedPushes]:
    """Make every weight sync a process / remote placement builds drop the pushes of `versions` (pytest's
    `monkeypatch` undoes it); returns the syncs made, as they are made."""
    from tokenmill.engines.remote import sync as servers

    made: list[DroppedPushes] = []
    real = servers.for_servers

    def wrapped(*args: Any, **kwargs: Any) -> DroppedPushes:
        made.append(DroppedPushes(real(*args, **kwargs), versions))
        return made[-1]

    monkeypatch.setattr(servers, "for_servers", wrapped)
    return made
