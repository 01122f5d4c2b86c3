"""Proxy mode: an agent program we did not write talks to tokenmill's OpenAI endpoint; we record its episodes.

The agent sends its requests to `http://HOST/proxy/<episode_id>/v1` (the OpenAI SDK's `base_url`), so any
program that lets you set a base URL takes part without code changes; it posts the episode's reward to
`/v1/episodes/<episode_id>/reward` when it knows it. The server records, for every call, the exact prompt
token ids it rendered, the sampled token ids, their logprobs and the policy version, so what the trainer
trains on is what the policy produced, never a re-tokenisation of the agent's text.

An episode's calls become samples like the agent loop's: when a call's prompt starts with everything the
episode has so far (prompt + earlier replies: the usual chat history), the new prompt tokens are appended
with loss mask 0 and the reply with loss mask 1, so a multi-turn episode is one sample; a call that does not
extend the history (the agent rewrote or summarised it) starts a new segment, a sample of its own. All
segments of an episode carry its reward.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.tracking.stages import stage
from tokenmill.types import Completion, Group, Sample, StopReason, TokenmillError


class EpisodeError(TokenmillError, ValueError):
    """An episode request that cannot be taken (unknown id, finished twice, bad reward); names the episode."""


@dataclass
class _Segment:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    prompt: Any
    completion: str = ""
    stop_reason: StopReason = StopReason.STOP
    version: int = 0


@dataclass
class RecordedEpisode:
    """One agent episode as recorded by the proxy; `group` is the key episodes are compared within (GRPO)."""

    episode_id: str
    group: str
    segments: list[_Segment] = field(default_factory=list)
    reward: float | None = None
    calls: int = 0
    started: float = field(default_factory=time.monotonic)

    def samples(self, group_id: int) -> list[Sample]:
        reward = float("nan") if self.reward is None else self.reward
        return [
            Sample(tokens=tuple(s.tokens), loss_mask=tuple(s.loss_mask), logprobs=tuple(s.logprobs),
                   prompt_len=s.prompt_len, prompt=s.prompt, completion=s.completion, stop_reason=s.stop_reason,
                   version=s.version, group_id=group_id, reward=reward, rewards={"agent": self.reward},
                   row={"episode_id": self.episode_id, "group": self.group, "calls": self.calls})
            for s in self.segments
        ]


class EpisodeRecorder:
    """Thread-safe store of proxy episodes: open ones being recorded, finished ones waiting for the trainer.

    max_open:  open episodes kept at once (a request for a new one beyond it is refused)
    ttl_s:     an open episode with no call for this long is dropped (the agent died or never reported)
    """

    def __init__(self, *, max_open: int = 10_000, ttl_s: float = 600.0) -> None:
        self.max_open, self.ttl_s = max_open, ttl_s
        self._open: dict[str, RecordedEpisode] = {}
        self._last_seen: dict[str, float] = {}
        self._finished: deque[RecordedEpisode] = deque()
        self._cond = threading.Condition()
        self.dropped = 0

    def record(self, episode_id: str, prompt_ids: list[int], completion: Completion, version: int,
               prompt: Any = None, group: str | None = None) -> None:
        """Add one call's prompt and reply to the episode (opening it on its first call)."""
        with self._cond:
            self._expire()
            ep = self._open.get(episode_id)
            if ep is None:
                if len(self._open) >= self.max_open:
                    raise EpisodeError(f"episode {episode_id!r}: {self.max_open} episodes already open")
                ep = self._open[episode_id] = RecordedEpisode(episode_id, group or episode_id)
            self._last_seen[episode_id] = time.monotonic()
            ep.calls += 1
            reply = list(completion.token_ids)
            last = ep.segments[-1] if ep.segments else None
            if last is not None and prompt_ids[: len(last.tokens)] == last.tokens:
                new = prompt_ids[len(last.tokens):]
                last.tokens += new + reply
                last.loss_mask += [0] * len(new) + [1] * len(reply)
                last.logprobs += [0.0] * len(new) + list(completion.logprobs)
                last.completion += completion.text
                last.stop_reason, last.version = completion.stop_reason, min(last.version, version)
            else:
                ep.segments.append(_Segment(
                    tokens=list(prompt_ids) + reply, loss_mask=[0] * len(prompt_ids) + [1] * len(reply),
                    logprobs=[0.0] * len(prompt_ids) + list(completion.logprobs), prompt_len=len(prompt_ids),
                    prompt=prompt, completion=completion.text, stop_reason=completion.stop_reason, version=version,
                ))

    def finish(self, episode_id: str, reward: float, group: str | None = None) -> RecordedEpisode:
        """Close the episode with its reward; it then waits in the finished queue for the trainer."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EpisodeError(f"episode {episode_id!r}: reward must be a finite number, got {reward!r}")
        with self._cond:
            ep = self._open.pop(episode_id, None)
            self._last_seen.pop(episode_id, None)
            if ep is None:
                raise EpisodeError(f"episode {episode_id!r} is not open (no call recorded, already finished, "
                                   f"or expired after {self.ttl_s:.0f} s without calls)")
            ep.reward = float(reward)
            if group is not None:
                ep.group = group
            self._finished.append(ep)
            self._cond.notify_all()
            return ep

    def take_finished(self, max_episodes: int, timeout_s: float = 0.0) -> list[RecordedEpisode]:
        """Up to `max_episodes` finished episodes, oldest first; wait up to `timeout_s` for the first one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._finished and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            out = []
            while self._finished and len(out) < max_episodes:
                out.append(self._finished.popleft())
            return out

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"open": len(self._open), "finished": len(self._finished), "dropped": self.dropped}

    def _expire(self) -> None:
        now = time.monotonic()
        for eid in [e for e, t in self._last_seen.items() if now - t > self.ttl_s]:
            self._open.pop(eid, None)
            self._last_seen.pop(eid)
            self.dropped += 1


def episodes_to_groups(episodes: list[RecordedEpisode], first_group: int = 0) -> list[Group]:
    """Episodes sharing a `group` key become one Group (GRPO compares them); order of first appearance."""
    by_key: dict[str, list[RecordedEpisode]] = {}
    for ep in episodes:
        by_key.setdefault(ep.group, []).append(ep)
    groups = []
    for i, eps in enumerate(by_key.values()):
        gid = first_group + i
        groups.append(Group(gid, tuple(s for ep in eps for s in ep.samples(gid))))
    return groups


class ProxyError(TokenmillError):
    """The proxy run cannot go on (the agent failed, or no episodes within the timeout); says what arrived."""


class ProxyCollector:
    """The proxy side of the `Rollout` protocol: waits until `len(rows)` groups of `group_size` finished
    episodes are complete (grouped by the `group` key the agent posts with the reward) and returns them. The
    rows only say how many groups a step wants: the external agent picks its own tasks.

    After `agent` (the process `proxy.agent_command` started, if any) exits and nothing complete is left,
    `rollout` returns what it has (possibly nothing) and `exhausted` turns True.
    """

    def __init__(self, recorder: EpisodeRecorder, group_size: int, wait_timeout_s: float,
                 agent: subprocess.Popen | None = None) -> None:
        self.recorder, self.group_size, self.wait_timeout_s, self.agent = recorder, group_size, wait_timeout_s, agent
        self.pending: dict[str, list[RecordedEpisode]] = {}  # episodes of groups not complete yet
        self.exhausted = False

    def rollout(self, rows: Sequence[Any], version: int, first_group: int = 0) -> tuple[list[Group], dict[str, float]]:
        """The recorded samples keep the versions the serving engine reported (`version` is not used)."""
        with stage("generate") as t:
            ready = self._collect(len(rows))
            groups = episodes_to_groups([e for g in ready for e in g], first_group)
            if t is not None:
                t.add_tokens("generate", sum(sum(s.loss_mask) for g in groups for s in g.samples))
        return groups, {f"proxy/{k}": float(v) for k, v in self.recorder.counts().items()}

    def _collect(self, want: int) -> list[list[RecordedEpisode]]:
        ready: list[list[RecordedEpisode]] = []
        deadline = time.monotonic() + self.wait_timeout_s
        while len(ready) < want:
            for ep in self.recorder.take_finished(10_000, timeout_s=0.5):
                self.pending.setdefault(ep.group, []).append(ep)
                if len(self.pending[ep.group]) == self.group_size:
                    ready.append(self.pending.pop(ep.group))
            if self.agent is not None and self.agent.poll() is not None and not self.recorder.counts()["finished"]:
                if self.agent.returncode != 0:
                    raise ProxyError(f"proxy.agent_command exited with status {self.agent.returncode}")
                self.exhausted = True
                return ready
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"proxy.wait_timeout_s: {len(ready)} of {want} complete groups of {self.group_size} episodes "
                    f"after {self.wait_timeout_s:g} s ({sum(map(len, self.pending.values()))} episodes in "
                    f"incomplete groups; {self.recorder.counts()['open']} open). Does the agent post rewards with "
                    f"a 'group' key?"
                )
        return ready
