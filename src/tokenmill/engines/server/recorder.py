"""The episode recorder of proxy mode: the server records, for every call an agent makes under an episode id,
the exact prompt token ids it rendered, the sampled token ids, their logprobs and the policy version, so what the
trainer trains on is what the policy produced, never a re-tokenisation of the agent's text.

An episode's calls become samples like the agent loop's: when a call's prompt starts with everything the
episode has so far (prompt + earlier replies: the usual chat history), the new prompt tokens are appended
with loss mask 0 and the reply with loss mask 1, so a multi-turn episode is one sample; a call that does not
extend the history (the agent rewrote or summarised it) starts a new segment, a sample of its own. All
segments of an episode carry its reward.

The server writes here (`proxy_routes`); the trainer's side, `rollout.proxy.ProxyCollector`, reads finished
episodes from here.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engines.local.routing import extend_routes, fit_routes
from tokenmill.types import Completion, Sample, StopReason, TokenmillError


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
    routes: Any = None  # the MoE routing of `tokens` (router replay r3), where the engine records it


@dataclass
class RecordedEpisode:
    """One agent episode as recorded by the proxy; `group` is the key episodes are compared within (GRPO)."""

    episode_id: str
    group: str
    segments: list[_Segment] = field(default_factory=list)
    reward: float | None = None
    calls: int = 0
    started: float = field(default_factory=time.monotonic)

    def samples(self, group_id: int, episode: int = -1) -> list[Sample]:
        """One sample per segment; `episode` >= 0 marks them as one episode's (`Sample.episode`: one advantage)."""
        reward = float("nan") if self.reward is None else self.reward
        return [
            Sample(tokens=tuple(s.tokens), loss_mask=tuple(s.loss_mask), logprobs=tuple(s.logprobs),
                   prompt_len=s.prompt_len, prompt=s.prompt, completion=s.completion, stop_reason=s.stop_reason,
                   version=s.version, group_id=group_id, reward=reward, rewards={"agent": self.reward},
                   row={"episode_id": self.episode_id, "group": self.group, "calls": self.calls}, episode=episode,
                   routes=None if s.routes is None else fit_routes(s.routes, len(s.tokens)))
            for s in self.segments
        ]


class EpisodeRecorder:
    """Thread-safe store of proxy episodes: open ones being recorded, finished ones waiting for the trainer.

    max_open:  open episodes kept at once (a request for a new one beyond it is refused)
    ttl_s:     an open episode with no call for this long is dropped (the agent died or never reported)
    stepwise:  every call its own segment (step-wise training), even where it extends the last one
    """

    def __init__(self, *, max_open: int = 10_000, ttl_s: float = 600.0, stepwise: bool = False) -> None:
        self.max_open, self.ttl_s, self.stepwise = max_open, ttl_s, stepwise
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
            if last is not None and not self.stepwise and prompt_ids[: len(last.tokens)] == last.tokens:
                new = prompt_ids[len(last.tokens):]
                last.tokens += new + reply
                last.loss_mask += [0] * len(new) + [1] * len(reply)
                last.logprobs += [0.0] * len(new) + list(completion.logprobs)
                last.completion += completion.text
                last.stop_reason, last.version = completion.stop_reason, min(last.version, version)
                if completion.routes is not None:  # each token's routing from the call that read it first
                    last.routes = extend_routes(last.routes, completion.routes)
            else:
                ep.segments.append(_Segment(
                    tokens=list(prompt_ids) + reply, loss_mask=[0] * len(prompt_ids) + [1] * len(reply),
                    logprobs=[0.0] * len(prompt_ids) + list(completion.logprobs), prompt_len=len(prompt_ids),
                    prompt=prompt, completion=completion.text, stop_reason=completion.stop_reason, version=version,
                    routes=completion.routes,
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
