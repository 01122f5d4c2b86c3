"""The feeds: where `run_rl` gets each step's scored groups, and where it hands the new weights.

`run_rl` (controller/rl.py) asks a *feed* for each step's groups and hands it the new weights after each
update. Four feeds, one protocol (`Feed`):

- `InlineFeed` (colocated engine): calls the loop's own `rollout` on the spot: the synchronous loop.
- `AsyncFeed` (engine placed elsewhere): runs the same `rollout` in a producer thread against an engine in
  a thread, `tokenmill serve` subprocesses or remote servers (`controller/placement.py`), and puts each
  step's scored groups into a bounded buffer that the trainer drains. Asynchronous training is the
  synchronous loop started early.
- `ProxyFeed` (`proxy:` section): serves a copy of the policy at an OpenAI endpoint, starts the agent
  program if asked, and runs the same `rollout` with the proxy collector in place of the generator.
- `ReplayFeed` (`record.replay`): each step's groups as a rollout dump recorded them; nothing generates.
  With `record.rollouts`, a `RecordingFeed` around any of them writes each step's groups to the dump.

Staleness (AsyncFeed), enforced per sample by the policy version that produced it: a sample trained at step s
comes from weights of version v (the trainer holds version s - 1 while it trains step s); its lag is
(s - 1) - v. The producer starts the rollout of step s only once version s - 1 - k is published (k =
`controller.max_staleness`): it *waits* rather than run more than k versions ahead, so with k = 0 every batch
is generated with the newest weights, after the previous update: the synchronous loop, step for step. The
trainer also checks every group's oldest sample and drops (and counts) groups older than k; that only happens
when an engine did not take an update (a restarted server), since the producer never runs further ahead.

Resume in async mode restores weights, optimiser, RNGs, the data position of the last *trained* batch (the
feed sets `run.source` to it as batches are taken) and the batches that were complete in the buffer (generated
ahead, not trained yet): the resumed run trains them first, with their original versions, and the producer
draws prompts after them. Only a batch still being generated at the checkpoint is lost; its prompts are
drawn again. A proxy run keeps nothing of the agent's episodes across a checkpoint: the agent plays on.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import torch

from tokenmill.controller.placement import Placement, build_placement, thread_split
from tokenmill.sandbox.lifetime import stop_process
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.types import Group, Sample, StopReason, TokenmillError

# the loop's rollout(run, step) -> (groups, sampling metrics): one step's prompts, generated and scored
RolloutFn = Callable[[Any, int], tuple[list[Group], dict[str, float]]]


class Feed(Protocol):
    """Where the loop's groups come from and where its weights go.

        >>> with rollout_feed(run, rollout, start=0) as feed:                    # doctest: +SKIP
        ...     for step in range(1, steps + 1):
        ...         groups, metrics = feed.get(step)    # None: the source ran dry (a proxy agent exited)
        ...         ...                                 # advantages, policy update
        ...         feed.push(step)                     # weights of version `step` to the engine side
        ...     state = feed.state_dict()               # for a checkpoint

    side: the label of the loop's stage events ("trainer" when a producer runs beside it; None when one side)
    """

    side: str | None

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        """The scored groups for `step` and the step's sampling metrics; None when nothing more will come."""
        ...

    def push(self, step: int) -> None:
        """Hand the trainer's weights, version `step`, to whatever generates."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the feed (`{"batches": [...]}`: rollouts generated ahead, not trained)."""
        ...

    def close(self, finish: bool = False) -> None:
        """Stop what the feed started; `finish` on a clean stop (work in flight may be kept)."""
        ...


class InlineFeed:
    """Colocated: the engine shares the trainer's module, so rollouts happen in place, one step at a time."""

    side = None  # one side: generation and training take turns in the trainer's step (stage events)

    def __init__(self, run, rollout: RolloutFn) -> None:
        self.run, self.rollout = run, rollout

    def get(self, step: int) -> tuple[list[Group], dict[str, float]]:
        return self.rollout(self.run, step)

    def push(self, step: int) -> None:
        """A version bump: the engine already samples from the updated module."""
        self.run.engine.update_weights(self.run.backend.weights(), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}  # nothing is generated ahead

    def close(self, finish: bool = False) -> None:
        pass


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
        # the producer's view of the run: its own engine, generator (or agent) and prompt position
        self.view = replace(run, engine=self.placement.engine, generator=self.placement.generator,
                            agent=self.placement.agent, actor=self.placement.agent or self.placement.generator,
                            source=copy.copy(run.source))
        try:
            self._push(start)
        except BaseException:
            self.placement.close()  # spawned servers go with it
            raise
        # generation and training share this machine's cores: split them (restored at close)
        self.threads, self.trainer_threads_before = thread_split(cfg), torch.get_num_threads()
        if self.threads[1] and run.engine.device.type == "cpu":
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
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it with context
            self._mark()
            self._put(exc)

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
        self.run.source.load_state_dict(item.data_state)  # what a checkpoint now records: the trained rows
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
            self.placement.push(self.run.backend.weights(), version)
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


class ProxyFeed:
    """Proxy mode: an external agent program plays against a copy of the policy served at
    `http://HOST:PORT/proxy/<episode id>/v1` and posts rewards; `get` runs the loop's `rollout` with the proxy
    collector, so dynamic sampling and overlong shaping apply as in any run.

    The serving copy lives in a continuous-batching engine: the agent keeps playing while the trainer trains,
    so its next episodes come from a policy at most a step old (each sample keeps the version it came from).
    """

    side = None  # one trainer side (the agent is not ours to label)

    def __init__(self, run, rollout: RolloutFn, start: int) -> None:
        from tokenmill.engines.local.continuous import ContinuousEngine
        from tokenmill.engines.server.app import create_app
        from tokenmill.engines.server.recorder import EpisodeRecorder
        from tokenmill.rollout.proxy import ProxyCollector
        from tokenmill.serving import check_exposure, start_in_thread

        cfg, pc = run.cfg, run.cfg.proxy
        check_exposure(pc.host, pc.token, pc.allow_remote, flag="proxy.allow_remote", token_flag="proxy.token")
        self.run, self.rollout, self.agent = run, rollout, None
        self.serving = ContinuousEngine(copy.deepcopy(run.model).eval(), run.tokenizer, seed=cfg.training.seed)
        self.serving.version = start
        self.recorder = EpisodeRecorder(ttl_s=pc.episode_ttl_s)
        app = create_app(self.serving, model_name="policy", token=pc.token, recorder=self.recorder,
                         default_max_tokens=cfg.generation.max_tokens, max_tokens_cap=cfg.generation.max_tokens)
        try:
            self.server, _ = start_in_thread(app, pc.host, pc.port)
        except BaseException:
            self.serving.close()
            raise
        run.logger.message(f"proxy endpoint: {self.server.url}/proxy/<episode id>/v1 (OpenAI API); post rewards "
                           f"to {self.server.url}/v1/episodes/<episode id>/reward")
        if pc.agent_command:
            argv = [a.replace("{url}", self.server.url).replace("{token}", pc.token or "none")
                    for a in pc.agent_command]
            try:
                self.agent = subprocess.Popen(argv)
            except OSError as exc:
                self.close()
                raise TokenmillError(f"proxy.agent_command: cannot start {argv[0]!r}: {exc}") from None
        self.collector = ProxyCollector(self.recorder, cfg.generation.group_size, pc.wait_timeout_s, self.agent)
        self.view = replace(run, actor=self.collector)

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        groups, info = self.rollout(self.view, step)
        if not groups and self.collector.exhausted:
            self.run.logger.message(f"the agent exited; stopping after {step - 1} step(s)")
            return None
        lags = [step - 1 - s.version for g in groups for s in g.samples] or [0]
        return groups, info | {"proxy/version_lag_mean": sum(lags) / len(lags),
                               "proxy/version_lag_max": float(max(lags))}

    def push(self, step: int) -> None:
        """The serving copy and the trainer's own engine take version `step` (in-flight replies finish on the
        old weights)."""
        self.serving.update_weights(self.run.backend.weights(), version=step)
        self.run.engine.update_weights(self.run.backend.weights(), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}  # episodes of incomplete groups are not kept: the agent plays on after a resume

    def close(self, finish: bool = False) -> None:
        if self.agent is not None and self.agent.poll() is None:
            stop_process(self.agent)
        self.server.stop()
        self.serving.close()


class ReplayFeed:
    """`record.replay`: each step's groups as a dump recorded them (`rollout/record.py`); nothing generates."""

    side = None

    def __init__(self, run) -> None:
        from tokenmill.rollout.record import read_dump

        self.run, self.steps = run, read_dump(run.cfg.record.replay)

    def get(self, step: int) -> tuple[list[Group], dict[str, float]] | None:
        if step not in self.steps and step > max(self.steps):  # the dump ends here: so does the run
            self.run.logger.message(f"replay: the dump ends at step {max(self.steps)}; stopping there")
            return None
        return self.steps.get(step, []), {}  # a step the dump skips had no groups

    def push(self, step: int) -> None:
        self.run.engine.update_weights((), version=step)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": []}

    def close(self, finish: bool = False) -> None:
        pass


class RecordingFeed:
    """`record.rollouts`: another feed, whose groups are also written to the run's dump as they are taken."""

    def __init__(self, feed: Feed, folder, every: int) -> None:
        from tokenmill.rollout.record import RolloutRecorder

        self.feed, self.side, self.recorder = feed, feed.side, RolloutRecorder(folder, every)

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


@contextlib.contextmanager
def rollout_feed(run, rollout: RolloutFn, start: int, buffered: dict | None = None) -> Iterator[Feed]:
    """The feed for `run`: the proxy feed when `proxy:` is set, the synchronous in-place feed for a colocated
    engine, else the producer thread (serving a checkpoint's `buffered` batches first). Closed on the way out
    (finishing work in flight only on a clean exit)."""
    rec = run.cfg.record
    if rec.replay is not None:
        feed: Feed = ReplayFeed(run)
    elif run.cfg.proxy is not None:
        feed = ProxyFeed(run, rollout, start)
    elif run.cfg.engine.placement == "colocated":
        feed = InlineFeed(run, rollout)
    else:
        feed = AsyncFeed(run, rollout, start, buffered)
    if rec.rollouts:
        feed = RecordingFeed(feed, rec.dir or run.output_dir / "rollouts", rec.every)
    try:
        yield feed
    except BaseException:
        feed.close(finish=False)
        raise
    feed.close(finish=True)
