"""`env.openenv:`: episodes against an OpenEnv environment (the HTTP/WebSocket environment standard TRL and
SkyRL speak), a server already running at `url` or one this run serves on loopback (`serve`).

    env:
      openenv:
        url: http://127.0.0.1:8000        # or serve: my_env.server:MyEnvironment (an OpenEnv Environment class)
        action: message                   # the reply text goes into this field of the action (or: json, module:fn)
        observation: message              # this field of the observation is the next user message (or: json, module:fn)
        system_prompt: "Guess my number."
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from tokenmill.config.section import Section

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _mapping_form(value: str, what: str) -> str:
    """A field name, 'json', or an import string ('module:function' / 'file.py:function')."""
    if value == "json" or _IDENTIFIER.fullmatch(value):
        return value
    module, sep, name = value.rpartition(":")
    if sep and module and name:
        return value
    raise ValueError(f"{value!r} is neither a field name of the {what}, 'json', nor 'module:function'")


class OpenEnvConfig(Section):
    """Where the OpenEnv server is and how text maps to its actions and observations."""

    url: str | None = Field(
        None, description="A running OpenEnv server (http(s):// or ws(s)://host:port); episodes use its /ws sessions.")
    serve: str | None = Field(
        None, description="An OpenEnv Environment subclass ('module:Class' or 'path/to/file.py:Class'; env.kwargs "
        "go to its constructor) or an OpenEnv FastAPI app ('module:app'), served on a free loopback port for the run.")
    action: str = Field(
        "message", description="How the policy's reply becomes the action: a field name (the reply text goes in "
        "that field), 'json' (the reply is the action as a JSON object, fenced or not), or "
        "'module:function' (text -> action dict; raise ValueError for an invalid reply). An invalid action ends "
        "the episode with reward 0.")
    observation: str = Field(
        "json", description="How an observation becomes the next user message: a field name (that field's value), "
        "'json' (the observation's fields as JSON), or 'module:function' (observation dict -> text or messages).")
    system_prompt: str | None = Field(None, description="A system message opening every episode.")
    task_prompt: bool = Field(
        True, description="Open the episode with the task row's prompt, then the reset observation (false: the "
        "reset observation alone, for environments that say everything themselves).")
    reset_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the environment's reset (the task row's columns, "
        "but its prompt, are sent too; the server passes on those the reset declares).")

    @field_validator("action")
    @classmethod
    def _action_form(cls, value: str) -> str:
        return _mapping_form(value, "action")

    @field_validator("observation")
    @classmethod
    def _observation_form(cls, value: str) -> str:
        return _mapping_form(value, "observation")

    @field_validator("url")
    @classmethod
    def _url_form(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(https?|wss?)://[^/\s]+(/\S*)?", value):
            raise ValueError(f"{value!r} is not an http(s):// or ws(s)://host:port URL")
        return value

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.serve is None):
            raise ValueError("set exactly one of env.openenv.url (a running server) or env.openenv.serve (an "
                             "environment this run serves)")
        return self
