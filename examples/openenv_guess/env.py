"""Guess the number as an OpenEnv environment: tokenmill's built-in `guess_number` game, written against
OpenEnv's server API (typed Action / Observation, `reset` / `step` / `state`), so any OpenEnv client can
play it and tokenmill trains on it through `env.openenv`.

Serve it yourself with OpenEnv's app factory (`uvicorn env:app --port 8000`), or let a run serve it
(`env: {openenv: {serve: env.py:GuessEnvironment}}`, see config.yaml).
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    message: str = Field(..., description="The guess, as the policy wrote it")


class GuessObservation(Observation):
    message: str = Field("", description="The range to guess in, 'higher', 'lower', or nothing once solved")


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """A number in [1, high], drawn from the reset's seed unless `secret` is given; each guess is answered
    'higher' or 'lower', a correct one ends the episode with reward 1, anything else is answered with the
    range again. The episode ends after `max_turns` guesses."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and nothing is shared

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__()
        self.max_turns = max_turns
        self.secret, self.high = 0, 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, secret: int | None = None,
              high: int = 7, **kwargs: Any) -> GuessObservation:
        self.high = int(high)
        self.secret = int(secret) if secret is not None else random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(message=f"1-{self.high}")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        last_turn = self._state.step_count >= self.max_turns
        found = re.fullmatch(r"\s*(\d{1,3})\s*", action.message)
        if found is None or not 1 <= int(found.group(1)) <= self.high:
            return GuessObservation(message=f"1-{self.high}?", reward=0.0, done=last_turn)
        guess = int(found.group(1))
        if guess == self.secret:
            return GuessObservation(message="", reward=1.0, done=True)
        return GuessObservation(message="higher" if guess < self.secret else "lower", reward=0.0, done=last_turn)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
