"""The asynchronous producer: `AsyncFeed` runs the loop's `rollout` in a thread ahead of the trainer, at most
`controller.max_staleness` policy versions ahead, against the engine its placement (`controller/placement.py`)
put elsewhere; `RolloutBatch` is one step's output in the bounded buffer (and in a checkpoint), and
`within_staleness` the trainer's per-group check. The package docstring explains the staleness rule and resume.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tokenmill.controller.feeds.base import RolloutFn
from tokenmill.controller.placement import Placement, build_placement, producer_side, thread_split
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.types import Group, Sample, StopReason, TokenmillError


@dataclass(frozen=True)
class RolloutBatch:
    """One step's scored groups, as the producer made them."""

    step: int
    groups: list[Group]
    info: dict[str, float]
    data_state: dict[str, int]  # the prompt source's position after this batch's rows
    tokens: int  # completion tokens generated
    busy_s: float  # seconds the producer spent making it (generation and rewards, not waiting)


    def state_dict(self) -> dict[str, Any]:
        """Plain data (what `torch.load(weights_only=True)` reads back)."""
        groups = [{"group_id": g.group_id, "samples": [{**asdict(s), "stop_reason": s.stop_reason.value}
                                                       for s in g.samples]} for g in self.groups]
        return {"step": self.step, "groups": groups, "info": self.info, "data_state": self.data_state,
                "tokens": self.tokens, "busy_s": self.busy_s}

    @staticmethod
    def from_state(state: dict[str, Any]) -> RolloutBatch:
        groups = [Group(g["group_id"], tuple(Sample(**{**s, "stop_reason": StopReason(s["stop_reason"])})
                                             for s in g["samples"])) for g in state["groups"]]
        return RolloutBatch(state["step"], groups, dict(state["info"]), dict(state["data_state"]),
                            state["tokens"], state["busy_s"])


def within_staleness(groups: list[Group], step: int, k: int) -> tuple[list[Group], list[Group], Counter[int]]:
    """(groups kept, groups dropped, the lag of every kept sample) for training step `step` with bound `k`:
    the trainer holds version step - 1, so a sample's lag is step - 1 - its version, and a group goes when its
    oldest sample lags more than k."""
    kept, stale, lag = [], [], Counter()
    for g in groups:
        if step - 1 - min(s.version for s in g.samples) > k:
            stale.append(g)
            continue
        kept.append(g)
        lag.update(step - 1 - s.version for s in g.samples)
    return kept, stale, lag


class ProducerError(TokenmillError):
    """The rollout producer failed; the message names the placement and the cause."""


class AsyncFeed:
    """A producer thread running `rollout` ahead of the trainer, at most `max_staleness` versions ahead."""

    side = "trainer"  # the loop's own stages; the producer thread labels its stages "producer"

    def __init__(self, run, rollout: RolloutFn, start: int, buffered: dict | None = None,
                 placement: Placement | None = None) -> None:
        cfg = run.cfg
        self.run, self.rollout = run, rollout
        self.k = cfg.controller.max_staleness
        self.timeout_s = cfg.controller.rollout_timeout_s
        self.placement = placement or build_placement(run)
        # the producer's own rollout side: its engine, generator (or agent loop) and prompt position
        self.view = producer_side(run, self.placement.engine)
        try:
            self._push(start)
        except BaseException:
            self.placement.close()  # spawned servers go with it
            raise
        # generation and training share this machine's cores: split them (restored at close)
        self.threads, self.trainer_threads_before = thread_split(cfg), torch.get_num_threads()
        if self.threads[1] and run.rollout.engine.device.type == "cpu":
            torch.set_num_threads(self.threads[1])
            run.logger.message(f"async ({cfg.engine.placement}): {self.threads[0]} torch thread(s) per engine, "
                               f"{self.threads[1]} for training")
        self.buffer: queue.Queue[RolloutBatch | BaseException] = queue.Queue(maxsize=self.k + 1)
        self.published = start
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.started = time.perf_counter()
        self.producer_busy = 0.0
        self.producer_blocked = 0.0
        self.trainer_waited = 0.0
        self.dropped_groups = 0
        self.dropped_samples = 0
        self.leftover: list[RolloutBatch] | None = None  # what close() found in the buffer
        # the step being generated, and a finished batch not yet queued: a checkpoint waits for the first and
        # keeps the second, so the rollout in flight is saved rather than generated again after a resume
        self.in_flight: int | None = None
        self.pending: RolloutBatch | None = None
        # the producer runs towards the run's last step (past a max_steps_per_run stop: a checkpoint keeps those)
        last = cfg.controller.steps
        first = start + 1 + self._restore(buffered or {}, start, last)
        self.thread = threading.Thread(target=self._produce, args=(first, last), name="tokenmill-rollout",
                                       daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------ producer
    def _produce(self, first: int, last: int) -> None:
        if self.threads[0]:
            torch.set_num_threads(self.threads[0])
        try:
            with self.placement.stream():  # thread placement on a GPU: a CUDA stream beside the trainer's
                self._produce_steps(first, last)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it with context
            self._mark()
            self._put(exc)

    def _produce_steps(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            if not self._wait_for_version(step - 1 - self.k):
                return
            self.placement.apply_pending()
            t0 = time.perf_counter()
            self._mark(in_flight=step)
            with step_timer(step, side="producer") as timer:
                groups, info = self.rollout(self.view, step)
            groups = self.placement.stamp_versions(groups)
            busy = time.perf_counter() - t0
            self.producer_busy += busy
            info = dict(info)
            for name, sec in timer.seconds.items():
                info[f"async/producer_{name}_s"] = sec
            batch = RolloutBatch(step, groups, info, self.view.source.state_dict(),
                                 timer.tokens.get("generate", 0), busy)
            self._mark(pending=batch)
            queued = self._put(batch)
            self._mark()
            if not queued:
                return

    def _mark(self, in_flight: int | None = None, pending: RolloutBatch | None = None) -> None:
        with self.cond:
            self.in_flight, self.pending = in_flight, pending
            self.cond.notify_all()

    def _wait_for_version(self, needed: int) -> bool:
        """Block until the trainer has published version `needed` (False when the feed is closing)."""
        t0 = time.perf_counter()
        with self.cond:
            while self.published < needed and not self.stopping.is_set():
                self.cond.wait(0.2)
        self.producer_blocked += time.perf_counter() - t0
        return not self.stopping.is_set()

    def _put(self, item: RolloutBatch | BaseException) -> bool:
        """Queue `item`; False when the feed is closing (a batch finished while closing is still queued if
        there is room, so that a checkpoint can keep it)."""
        t0 = time.perf_counter()
        while True:
            try:
                self.buffer.put(item, timeout=0.2)
                self.producer_blocked += time.perf_counter() - t0
                return not self.stopping.is_set()
            except queue.Full:
                if self.stopping.is_set():
                    return False

    # ------------------------------------------------------------------------------------------- trainer
    def get(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups for `step` (stale groups dropped) and the step's sampling and async metrics."""
        fill = self.buffer.qsize()
        t0 = time.perf_counter()
        with stage("wait") as timer:
            try:
                item = self.buffer.get(timeout=self.timeout_s)
            except queue.Empty:
                alive = "alive" if self.thread.is_alive() else "dead"
                raise ProducerError(
                    f"async: no rollout batch for step {step} within controller.rollout_timeout_s="
                    f"{self.timeout_s:g}s (producer thread {alive}, placement {self.placement.describe()})"
                ) from None
        waited = time.perf_counter() - t0
        self.trainer_waited += waited
        if isinstance(item, BaseException):
            raise ProducerError(f"async: the rollout producer ({self.placement.describe()}) failed: "
                                f"{type(item).__name__}: {item}") from item
        if item.step != step:
            raise ProducerError(f"async: expected the rollout of step {step}, got step {item.step}")
        if timer is not None:
            timer.add_tokens("generate", item.tokens)
        self.run.rollout.source.load_state_dict(item.data_state)  # what a checkpoint now records: the trained rows
        groups, stale, lag = within_staleness(item.groups, step, self.k)
        self.dropped_groups += len(stale)
        self.dropped_samples += sum(len(g.samples) for g in stale)
        return groups, item.info | self._metrics(step, fill, waited, lag)

    def _metrics(self, step: int, fill: int, waited: float, lag: Counter[int]) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        n = sum(lag.values())
        out: dict[str, Any] = {
            "async/buffer_fill": fill,
            "async/wait_s": waited,
            # shares of the wall time since the feed started: the producer generating and scoring, the trainer
            # doing anything but waiting for a batch (what overlap buys is both near 1)
            "async/generate_busy": min(1.0, self.producer_busy / elapsed),
            "async/train_busy": max(0.0, 1.0 - self.trainer_waited / elapsed),
            "async/producer_blocked_s": self.producer_blocked,
            "async/staleness_mean": sum(k * v for k, v in lag.items()) / n if n else 0.0,
            "async/staleness_max": max(lag, default=0),
            "async/dropped_stale_groups": self.dropped_groups,
            "async/dropped_stale_samples": self.dropped_samples,
            "async/policy_version": self.published,
        }
        for k in range(self.k + 1):
            out[f"async/staleness_share/{k}"] = lag.get(k, 0) / n if n else 0.0
        # the buffer empty at the trainer's turn: generation is the bottleneck; full: training is
        out["async/bottleneck"] = "generation" if fill == 0 else "training"
        return out

    def push(self, step: int) -> None:
        """Hand the new weights (version `step`) to the engine side and let the producer run on."""
        self._push(step)
        with self.cond:
            self.published = step
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The batches generated ahead and not trained yet: a checkpoint keeps them, and first waits (at most
        `controller.rollout_timeout_s`) for the rollout in flight to finish, so that it is kept too."""
        if self.leftover is not None:
            return {"batches": [b.state_dict() for b in self.leftover]}
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while self.in_flight is not None and self.thread.is_alive() and time.monotonic() < deadline:
                self.cond.wait(0.2)
            with self.buffer.mutex:
                batches = [b for b in self.buffer.queue if isinstance(b, RolloutBatch)]
            if self.pending is not None and all(b is not self.pending for b in batches):
                batches.append(self.pending)  # finished, waiting for room in the buffer
        return {"batches": [b.state_dict() for b in batches]}

    def _restore(self, buffered: dict, start: int, last: int) -> int:
        """Queue a checkpoint's buffered batches (steps start + 1, ...) and move the producer's prompt position
        past them; return how many. Batches that do not follow on are ignored (their rows are drawn again)."""
        batches = [RolloutBatch.from_state(b) for b in buffered.get("batches", [])]
        restored = 0
        for batch in batches[: self.k + 1]:
            if batch.step != start + 1 + restored or batch.step > last:
                break
            self.buffer.put_nowait(batch)
            self.view.source.load_state_dict(batch.data_state)
            restored += 1
        return restored

    def _push(self, version: int) -> None:
        try:
            self.placement.push(self.run.trainer.backend.weights(), version)
        except Exception as exc:  # one error naming the engine side and the cause
            raise ProducerError(f"async: pushing weights (version {version}) to {self.placement.describe()} "
                                f"failed: {type(exc).__name__}: {exc}") from exc

    def close(self, finish: bool = False) -> None:
        """Stop the producer. With `finish` (a clean stop), the rollout in progress is completed and kept for
        the checkpoint; otherwise it is abandoned (its thread ends within the engine's own timeout)."""
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()
        if finish:
            self.thread.join(timeout=self.timeout_s)
        leftover = []
        with contextlib.suppress(queue.Empty):
            while True:
                leftover.append(self.buffer.get_nowait())
        self.leftover = [b for b in leftover if isinstance(b, RolloutBatch)]
        self.thread.join(timeout=max(5.0, min(self.timeout_s, 60.0)))  # a request in flight ends within its timeout
        self.placement.close()
        torch.set_num_threads(self.trainer_threads_before)
