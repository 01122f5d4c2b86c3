"""Proxy mode: an agent program we did not write talks to tokenmill's OpenAI endpoint; we record its episodes.

The agent sends its requests to `http://HOST/proxy/<episode_id>/v1` (the OpenAI SDK's `base_url`), so any
program that lets you set a base URL takes part without code changes; it posts the episode's reward to
`/v1/episodes/<episode_id>/reward` when it knows it. The server records, for every call, the exact prompt
token ids it rendered, the sampled token ids, their logprobs and the policy version, so what the trainer
trains on is what the policy produced, never a re-tokenisation of the agent's text.

The server side (the routes and the `EpisodeRecorder` they write to) is `tokenmill.engines.server`; this
module is the trainer's side: it groups finished episodes for the trainer.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.engines.server.recorder import EpisodeRecorder, RecordedEpisode
from tokenmill.tracking.stages import stage
from tokenmill.types import Group, TokenmillError


def episodes_to_groups(episodes: list[RecordedEpisode], first_group: int = 0,
                       stepwise: bool = False) -> list[Group]:
    """Episodes sharing a `group` key become one Group (GRPO compares them); order of first appearance.
    `stepwise`: each episode's samples (one per call) are marked as its own, so they share one advantage."""
    by_key: dict[str, list[RecordedEpisode]] = {}
    for ep in episodes:
        by_key.setdefault(ep.group, []).append(ep)
    groups = []
    for i, eps in enumerate(by_key.values()):
        gid = first_group + i
        groups.append(Group(gid, tuple(s for k, ep in enumerate(eps)
                                       for s in ep.samples(gid, episode=k if stepwise else -1))))
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
            groups = episodes_to_groups([e for g in ready for e in g], first_group, self.recorder.stepwise)
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
