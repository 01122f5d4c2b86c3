"""The proxy's episode recorder: calls that extend the history merge into one sample with the right loss mask."""

from __future__ import annotations

import math
import threading
import time

import pytest

from tokenmill.engines.server.recorder import EpisodeError, EpisodeRecorder
from tokenmill.rollout.proxy import episodes_to_groups
from tokenmill.types import Completion, StopReason


def _c(ids, lps, text="", reason=StopReason.STOP):
    return Completion(tuple(ids), tuple(lps), reason, text)


def test_a_multi_turn_episode_is_one_sample_with_observations_masked():
    rec = EpisodeRecorder()
    rec.record("e1", [1, 2, 3], _c([7, 8], [-0.5, -0.25], "ab"), version=4, group="task-9")
    # the next call's prompt is the whole history plus the environment's reply [20, 21]
    rec.record("e1", [1, 2, 3, 7, 8, 20, 21], _c([9], [-1.0], "c"), version=5)
    ep = rec.finish("e1", reward=0.75)
    [s] = ep.samples(group_id=3)
    assert s.tokens == (1, 2, 3, 7, 8, 20, 21, 9)
    assert s.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1)
    assert s.logprobs == (0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0)
    assert s.prompt_len == 3 and s.completion == "abc" and s.reward == 0.75
    assert s.version == 4  # the oldest policy that wrote any of it
    assert s.group_id == 3 and s.row["group"] == "task-9" and s.row["calls"] == 2


def test_a_call_that_rewrites_the_history_starts_a_new_segment():
    rec = EpisodeRecorder()
    rec.record("e", [1, 2], _c([3], [-0.1]), version=0)
    rec.record("e", [5, 6, 7], _c([8, 9], [-0.2, -0.3], reason=StopReason.LENGTH), version=1)
    samples = rec.finish("e", 1.0).samples(0)
    assert [s.tokens for s in samples] == [(1, 2, 3), (5, 6, 7, 8, 9)]
    assert [s.loss_mask for s in samples] == [(0, 0, 1), (0, 0, 0, 1, 1)]
    assert samples[1].stop_reason is StopReason.LENGTH and all(s.reward == 1.0 for s in samples)


def test_finish_errors_name_the_episode():
    rec = EpisodeRecorder()
    with pytest.raises(EpisodeError, match="'nope' is not open"):
        rec.finish("nope", 1.0)
    rec.record("e", [1], _c([2], [-0.1]), version=0)
    with pytest.raises(EpisodeError, match="finite number"):
        rec.finish("e", float("nan"))
    rec.finish("e", 0.0)
    with pytest.raises(EpisodeError, match="'e' is not open"):
        rec.finish("e", 1.0)


def test_take_finished_waits_for_the_first_episode_and_groups_by_key():
    rec = EpisodeRecorder()
    for eid, key, r in [("a", "t1", 1.0), ("b", "t2", 0.0), ("c", "t1", 0.0)]:
        rec.record(eid, [1], _c([2], [-0.1]), version=0, group=key)
    assert rec.take_finished(10, timeout_s=0.05) == []
    threading.Timer(0.1, lambda: [rec.finish(e, r) for e, r in [("a", 1.0), ("b", 0.0), ("c", 0.0)]]).start()
    t0 = time.monotonic()
    got = rec.take_finished(2, timeout_s=5.0)
    assert 0.05 < time.monotonic() - t0 < 2.0
    got += rec.take_finished(10, timeout_s=1.0)
    assert [e.episode_id for e in got] == ["a", "b", "c"]
    groups = episodes_to_groups(got, first_group=10)
    assert [g.group_id for g in groups] == [10, 11]
    assert [g.rewards_G for g in groups] == [[1.0, 0.0], [0.0]]
    assert rec.counts() == {"open": 0, "finished": 0, "dropped": 0}


def test_an_episode_without_a_reward_is_not_trainable_and_idle_ones_expire():
    rec = EpisodeRecorder(ttl_s=0.05)
    rec.record("old", [1], _c([2], [-0.1]), version=0)
    time.sleep(0.1)
    rec.record("new", [1], _c([2], [-0.1]), version=0)
    assert rec.counts() == {"open": 1, "finished": 0, "dropped": 1}
    [s] = rec._open["new"].samples(0)
    assert math.isnan(s.reward) and not s.trainable


def test_stepwise_recording_keeps_every_call_and_one_advantage_per_episode():
    from tokenmill.algorithms.advantages import assign_advantages

    rec = EpisodeRecorder(stepwise=True)
    # episode a: two calls, the second extending the first (append-only), still two samples; b and c: one call
    rec.record("a", [1, 2], _c([3], [-0.1]), version=0, group="t")
    rec.record("a", [1, 2, 3, 4], _c([5, 6], [-0.2, -0.3]), version=0)
    rec.record("b", [1, 2], _c([7], [-0.4]), version=0, group="t")
    rec.record("c", [1, 2], _c([8], [-0.5]), version=0, group="t")
    episodes = [rec.finish("a", 1.0), rec.finish("b", 0.0), rec.finish("c", 0.5)]
    assert [s.tokens for s in episodes[0].samples(0)] == [(1, 2, 3), (1, 2, 3, 4, 5, 6)]
    assert [s.loss_mask for s in episodes[0].samples(0)] == [(0, 0, 1), (0, 0, 0, 0, 1, 1)]
    [group] = assign_advantages(episodes_to_groups(episodes, stepwise=True), "grpo")
    assert [s.episode for s in group.samples] == [0, 0, 1, 2]
    # GRPO over the three episodes' returns 1, 0, 0.5: mean 0.5, std 0.5; a's two calls share +1
    assert [round(s.advantage, 3) for s in group.samples] == [1.0, 1.0, -1.0, 0.0]
    # without step-wise marks, a's two samples would count twice in the group's statistics
    [plain] = assign_advantages(episodes_to_groups(episodes), "grpo")
    assert [s.episode for s in plain.samples] == [-1] * 4 and plain.samples[0].advantage != pytest.approx(1.0, abs=1e-3)


def test_recorded_routing_comes_from_the_call_that_read_each_token_first():
    """Router replay r3 in proxy mode: [tokens, layers x top_k] per call, -1 for the never-read last token."""
    import torch

    def routes(rows):
        return torch.tensor(rows, dtype=torch.int16)

    rec = EpisodeRecorder()
    rec.record("e", [1, 2], Completion((7, 8), (-0.5, -0.25), StopReason.STOP, "ab",
                                       routes=routes([[0, 1], [2, 3], [4, 5], [-1, -1]])), version=0)
    # the second call read the history again (its own routing of it differs) and the observation [20]
    second = routes([[3, 3], [3, 3], [3, 3], [6, 7], [0, 2], [-1, -1]])
    rec.record("e", [1, 2, 7, 8, 20], Completion((9,), (-1.0,), StopReason.STOP, "c", routes=second), version=0)
    rec.record("e", [40], Completion((41,), (-1.0,), StopReason.STOP, "d"), version=0)  # recorded without routing
    first, other = rec.finish("e", 1.0).samples(0)
    assert first.routes.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2], [-1, -1]]
    assert other.routes is None
