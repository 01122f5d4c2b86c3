"""Proxy mode's episode routes; the sampling routes are the server's own (`create_app(..., recorder=...)`).

    POST /proxy/{episode_id}/v1/chat/completions   the server's chat route, one reply, recorded
    POST /proxy/{episode_id}/v1/completions        the server's completions route, one prompt, recorded
    GET  /proxy/{episode_id}/v1/models             what the OpenAI SDK asks first, sometimes
    POST /v1/episodes/{episode_id}/reward          {"reward": 1.0, "group": "task-7"} ends the episode
    GET  /v1/episodes                              open / finished / dropped counts

The episode id lives in the URL so that an agent program only needs its `base_url` changed. One reply per
call (`n` = 1): an episode is one trajectory; GRPO's group is formed from several episodes that share a
`group` key. Everything sits behind the server's token and Host checks, and errors come back in its
OpenAI shape.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.engines.server.recorder import EpisodeError, EpisodeRecorder

_EPISODE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float
    group: str | None = Field(None, max_length=256)


def check_episode_id(episode_id: str) -> None:
    if not _EPISODE.match(episode_id):
        raise HTTPException(400, "episode_id: 1-128 characters of A-Z a-z 0-9 _ . : -")


def episode_routes(recorder: EpisodeRecorder) -> APIRouter:
    """The routes that end episodes with their reward and count them."""
    router = APIRouter()

    @router.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, body: _Reward) -> dict[str, Any]:
        check_episode_id(episode_id)
        try:
            ep = recorder.finish(episode_id, body.reward, group=body.group)
        except EpisodeError as exc:
            raise HTTPException(404 if "not open" in str(exc) else 400, str(exc)) from None
        return {"episode_id": episode_id, "calls": ep.calls, "reward": ep.reward, "group": ep.group}

    @router.get("/v1/episodes")
    async def counts() -> dict[str, int]:
        return recorder.counts()

    return router
