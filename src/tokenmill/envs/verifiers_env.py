"""verifiers environments (`env: {verifiers: ...}`): a verifiers v1 environment loaded by its id, its tasks as
the run's rows, and the in-process chat harness its agent plays with when it brings no harness of its own.

A verifiers v1 environment is a taskset (an importable package or module exporting a `vf.Taskset` subclass
through `__all__`; its tasks score themselves with `@vf.reward` methods and judges), optionally with its own
`vf.Env` (how one task becomes an episode) and `vf.Harness` (the program that talks to the model). `load`
builds the `vf.Env` exactly as `vf-eval` does (`vf.load_environment`), with the agent's runtime on this
machine; `rollout/verifiers_rollout.py` runs its episodes against tokenmill's engine.

    >>> env = load("my_env", {"taskset": {"num_tasks": 100}})   # doctest: +SKIP
    >>> env.rows[0]                                             # doctest: +SKIP
    {'prompt': '2+3=', 'task': 0}

The built-in verifiers harnesses install their chat program with `uv` at run time (network); `ChatHarness`
(id `tokenmill-chat`) is the same loop run in-process: chat completions through the rollout's interception
endpoint, the task's MCP tools called between turns, until a reply without tool calls.
"""

from __future__ import annotations

import functools
import json
import ssl
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.types import ConfigError

try:
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
    from verifiers.v1.runtimes import ProgramResult
except ImportError as exc:  # the extra is not installed: one line naming it
    raise ConfigError(f"env.verifiers: needs the verifiers package ({exc.name} is missing); "
                      "pip install tokenmill[verifiers]") from None

HARNESS_ID = "tokenmill-chat"


class ChatHarnessConfig(vf.HarnessConfig):
    max_turns: int = 8
    """Model calls per episode at most (a reply with tool calls is followed by another call)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """The chat loop of verifiers' `null` harness, in this process: every model call goes through the
    rollout's interception `endpoint` (so the trace records it), the task's MCP tools run between calls."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:  # a resumed exchange: the conversation so far, in OpenAI's shape
            messages += [message_to_wire(m) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                             http_client=httpx.AsyncClient(verify=_tls(), timeout=None))
        async with AsyncExitStack() as stack:
            stack.push_async_callback(client.close)
            servers_cfg = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                          for name, url in mcp_urls.items()}}
            tools, dispatch, servers = await connect_mcp(servers_cfg, stack) if mcp_urls else ([], {}, {})
            for _ in range(self.config.max_turns):
                kwargs = {"tools": tools} if tools else {}
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, **kwargs)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": await _tool_result(servers, dispatch, call)})
        return ProgramResult(exit_code=0, stdout="", stderr="")


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every episode's client (building one reads the CA bundle: ~20 ms each)."""
    return ssl.create_default_context()


async def _tool_result(servers, dispatch, call) -> Any:
    """The tool's answer, or an error text the model sees (a bad call is the policy's mistake, not a crash)."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not JSON ({exc})"
    if call.function.name not in dispatch:
        return f"error: unknown tool {call.function.name!r}"
    if not isinstance(args, dict):
        return "error: the arguments must be a JSON object"
    return await call_mcp(servers, dispatch, call.function.name, args)


__all__ = ["ChatHarness"]


@dataclass
class LoadedEnv:
    """A loaded verifiers environment: the `vf.Env`, its tasks, and one row per task for the run's data."""

    spec: str
    env: Any  # vf.Env
    tasks: list[Any]  # vf.Task, by their `task` row key

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [{"prompt": t.data.prompt_text, "task": i} for i, t in enumerate(self.tasks)]


def _register(name: str, module: Any) -> None:
    """verifiers imports plugins by a top-level module name; ours (and a file's) are put under one."""
    sys.modules.setdefault(name, module)


def _taskset_id(spec: str) -> str:
    """The taskset id of `spec`: an installed package / module name, or a `.py` file (imported under its stem)."""
    if not spec.endswith(".py"):
        return spec
    from tokenmill.config.imports import load_file

    name = Path(spec).stem.replace("-", "_").lower()
    module = load_file(spec, "env.verifiers")
    _register(name, module)
    return name


def env_config(taskset_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The verifiers `[env]` block: `kwargs` (its `taskset` fields, its roles such as `agent`, `id`...) with the
    taskset id and, for each role of the env, a runtime on this machine and, unless the taskset or the role
    names one, our chat harness."""
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    raw = json.loads(json.dumps(kwargs))  # a deep copy of plain data
    raw["taskset"] = {**raw.get("taskset", {}), "id": taskset_id}
    fields = env_config_type(taskset_id, raw.get("id") or "").model_fields
    roles = [name for name, f in fields.items() if isinstance(f.default, vf.AgentConfig)]
    for role in roles:
        seat = raw.setdefault(role, {})
        seat.setdefault("runtime", {"type": "subprocess"})
        if "harness" not in seat and fields[role].default.harness is None and default_harness_id(taskset_id) == "bash":
            seat["harness"] = {"id": HARNESS_ID}
    return raw


def load(spec: str, kwargs: dict[str, Any] | None = None) -> LoadedEnv:
    """The verifiers environment `spec` (a taskset id or a `.py` file) with `kwargs` (the verifiers `[env]`
    block); a ConfigError naming `env.verifiers` / `env.kwargs` and the environment's own error otherwise."""
    _register("tokenmill_chat", sys.modules[__name__])
    taskset_id = _taskset_id(spec)
    try:
        config = vf.resolve_env_config(env_config(taskset_id, kwargs or {}))
        env = vf.load_environment(config)
    except (ModuleNotFoundError, AttributeError, TypeError) as exc:
        raise ConfigError(f"env.verifiers: cannot load {spec!r}: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a taskset that fails to build: its own error, in one line
        raise ConfigError(f"env.kwargs: verifiers environment {spec!r} failed to load: {_one_line(exc)}") from None
    try:
        tasks = list(env.taskset if env.taskset.bounded else env.taskset.take(100_000))
    except Exception as exc:  # noqa: BLE001 - as above, raised while the taskset yields its tasks
        raise ConfigError(f"env.verifiers: {spec!r} failed while loading its tasks: {_one_line(exc)}") from None
    if not tasks:
        raise ConfigError(f"env.verifiers: {spec!r} has no tasks")
    return LoadedEnv(spec, env, tasks)


_LOADED: dict[str, LoadedEnv] = {}


def load_cached(spec: str, kwargs: dict[str, Any] | None = None) -> LoadedEnv:
    """`load`, once per (spec, kwargs) in this process: the run's rows and its rollout index the same tasks."""
    key = json.dumps([spec, kwargs or {}], sort_keys=True, default=str)
    if key not in _LOADED:
        _LOADED[key] = load(spec, kwargs)
    return _LOADED[key]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:500]}"
