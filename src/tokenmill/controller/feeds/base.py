"""The `Feed` protocol and `rollout_feed`, which picks the feed a run's config asks for (see the package
docstring for the four feeds and how the asynchronous one bounds staleness)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from tokenmill.types import Group

# the loop's rollout(side, step) -> (groups, sampling metrics): one step's prompts, generated and scored with a
# rollout side (`controller.build.RolloutSide`: the trainer's, or a producer's own)
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


@contextlib.contextmanager
def rollout_feed(run, rollout: RolloutFn, start: int, buffered: dict | None = None) -> Iterator[Feed]:
    """The feed for `run`: the proxy feed when `proxy:` is set, the synchronous in-place feed for a colocated
    engine, else the producer thread (serving a checkpoint's `buffered` batches first). Closed on the way out
    (finishing work in flight only on a clean exit)."""
    # the feeds import this module (RolloutFn): the chooser imports them when it runs
    from tokenmill.controller.feeds.inline import InlineFeed, RecordingFeed, ReplayFeed
    from tokenmill.controller.feeds.producer import AsyncFeed
    from tokenmill.controller.feeds.proxy import ProxyFeed

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
        from tokenmill.checkpoint.recording import run_fingerprint

        feed = RecordingFeed(feed, rec.dir or run.output_dir / "rollouts", rec.every, run_fingerprint(run.cfg))
    try:
        yield feed
    except BaseException:
        feed.close(finish=False)
        raise
    feed.close(finish=True)
