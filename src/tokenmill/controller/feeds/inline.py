"""The feeds that run nothing beside the trainer: `InlineFeed` (the synchronous loop, rollouts in place),
`ReplayFeed` (groups read back from a rollout dump) and `RecordingFeed` (any feed, its groups also written to
the run's dump)."""

from __future__ import annotations

from typing import Any

from tokenmill.controller.feeds.base import Feed, RolloutFn
from tokenmill.types import Group, TokenmillError


def _call(obj, name: str) -> None:
    method = getattr(obj, name, None)
    if callable(method):
        method()


class InlineFeed:
    """Colocated: the engine shares the trainer's module, so rollouts happen in place, one step at a time."""

    side = None  # one side: generation and training take turns in the trainer's step (stage events)

    def __init__(self, run, rollout: RolloutFn) -> None:
        self.run, self.rollout = run, rollout

    def get(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """One step's rollouts. The engine and the trainer share one device's memory and take turns: the
        trainer's leftovers (gradients, cached activation blocks) go before the engine decodes, the engine's
        key/value cache and graphs after, before the update (`release_memory` on each, where it has one)."""
        engine, backend = self.run.rollout.engine, self.run.trainer.backend
        _call(backend, "release_memory")
        _call(engine, "restore_memory")
        got = self.rollout(self.run.rollout, step)
        _call(engine, "release_memory")
        return got

    def push(self, step: int) -> None:
        """A version bump: the engine already samples from the updated module."""
        self.run.rollout.engine.update_weights(self.run.trainer.backend.weights(), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}  # nothing is generated ahead

    def close(self, finish: bool = False) -> None:
        pass


class ReplayFeed:
    """`record.replay`: each step's groups as a dump recorded them (`rollout/record.py`); nothing generates."""

    side = None

    def __init__(self, run) -> None:
        from tokenmill.checkpoint.recording import fingerprint_changes, run_fingerprint
        from tokenmill.rollout.record import read_dump, read_manifest

        folder = run.cfg.record.replay
        recorded = read_manifest(folder).get("fingerprint")  # None: recorded before recordings kept one
        changes = fingerprint_changes(recorded, run_fingerprint(run.cfg)) if recorded is not None else []
        if changes:
            raise TokenmillError(f"record.replay: {str(folder)!r} was recorded with other settings than this run's: "
                                 f"{'; '.join(changes)}; the recorded rollouts mean nothing under these, so set "
                                 "them back to the recording's (or record again)")
        self.run, self.steps = run, read_dump(folder)

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        if step not in self.steps and step > max(self.steps):  # the dump ends here: so does the run
            self.run.logger.message(f"replay: the dump ends at step {max(self.steps)}; stopping there")
            return None
        return self.steps.get(step, []), {}  # a step the dump skips had no groups

    def push(self, step: int) -> None:
        self.run.rollout.engine.update_weights((), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}

    def close(self, finish: bool = False) -> None:
        pass


class RecordingFeed:
    """`record.rollouts`: another feed, whose groups are also written to the run's dump as they are taken."""

    def __init__(self, feed: Feed, folder, every: int, fingerprint: dict[str, Any] | None = None) -> None:
        from tokenmill.rollout.record import RolloutRecorder

        self.feed, self.side, self.recorder = feed, feed.side, RolloutRecorder(folder, every, fingerprint)

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        got = self.feed.get(step)
        if got is not None:
            self.recorder.add(step, got[0])
        return got

    def push(self, step: int) -> None:
        self.feed.push(step)

    def state_dict(self) -> dict[str, Any]:
        self.recorder.flush()  # a checkpoint never lies ahead of the dump
        return self.feed.state_dict()

    def close(self, finish: bool = False) -> None:
        self.recorder.flush()
        self.feed.close(finish)
