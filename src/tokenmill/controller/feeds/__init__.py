"""The feeds: where `run_rl` gets each step's scored groups, and where it hands the new weights.

`run_rl` (controller/rl.py) asks a *feed* for each step's groups and hands it the new weights after each
update. Four feeds, one protocol (`Feed`, in `base.py` with `rollout_feed`, which chooses one):

- `InlineFeed` (colocated engine, `inline.py`): calls the loop's own `rollout` on the spot: the synchronous
  loop.
- `AsyncFeed` (engine placed elsewhere, `producer.py`): runs the same `rollout` in a producer thread against an
  engine in a thread, `tokenmill serve` subprocesses or remote servers (`controller/placement.py`), and puts
  each step's scored groups into a bounded buffer that the trainer drains. Asynchronous training is the
  synchronous loop started early.
- `ProxyFeed` (`proxy:` section, `proxy.py`): serves a copy of the policy at an OpenAI endpoint, starts the
  agent program if asked (`rollout.proxy_service.ProxyService`), and runs the same `rollout` with the proxy
  collector in place of the generator.
- `ReplayFeed` (`record.replay`, `inline.py`): each step's groups as a rollout dump recorded them; nothing
  generates. With `record.rollouts`, a `RecordingFeed` around any of them writes each step's groups to the dump.

Staleness (AsyncFeed), enforced per sample by the policy version that produced it: a sample trained at step s
comes from weights of version v (the trainer holds version s - 1 while it trains step s); its lag is
(s - 1) - v. The producer starts the rollout of step s only once version s - 1 - k is published (k =
`controller.max_staleness`): it *waits* rather than run more than k versions ahead, so with k = 0 every batch
is generated with the newest weights, after the previous update: the synchronous loop, step for step. The
trainer also checks every group's oldest sample and drops (and counts) groups older than k; that only happens
when an engine did not take an update (a restarted server), since the producer never runs further ahead.

Resume in async mode restores weights, optimiser, RNGs, the data position of the last *trained* batch (the
feed sets `run.rollout.source` to it as batches are taken) and the batches that were complete in the buffer (generated
ahead, not trained yet): the resumed run trains them first, with their original versions, and the producer
draws prompts after them. Only a batch still being generated at the checkpoint is lost; its prompts are
drawn again. A proxy run keeps nothing of the agent's episodes across a checkpoint: the agent plays on.

A new feed is one module here with the four `Feed` methods, and one branch in `rollout_feed`.
"""

from tokenmill.controller.feeds.base import Feed, RolloutFn, rollout_feed
from tokenmill.controller.feeds.inline import InlineFeed, RecordingFeed, ReplayFeed
from tokenmill.controller.feeds.producer import AsyncFeed, ProducerError, RolloutBatch, within_staleness
from tokenmill.controller.feeds.proxy import ProxyFeed

__all__ = ["AsyncFeed", "Feed", "InlineFeed", "ProducerError", "ProxyFeed", "RecordingFeed", "ReplayFeed",
           "RolloutBatch", "RolloutFn", "rollout_feed", "within_staleness"]
