"""Tools in the OpenAI function-calling format: a registry built from typed Python functions, and a parser for
the calls a model writes.

    tools = ToolRegistry()

    @tools.register
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    tools.specs()                 # [{"type": "function", "function": {"name": "add", "parameters": {...}}}]
    calls = HermesToolCallParser().parse(text)      # <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    tools.answer(calls)           # [{"role": "tool", "tool_call_id": ..., "name": "add", "content": "5"}]

The JSON schema comes from the signature (int, float, bool, str, list[...], dict, Literal[...], Optional, and
defaults for what is not required); the description from the docstring's first paragraph. A malformed call
(bad JSON, unknown tool, wrong or missing arguments, a tool that raises) becomes an error observation the
model can read and correct: nothing here raises on model output.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

# the tool-call parser is the engine server's too (OpenAI `tool_calls`), so it lives below both
from tokenmill.tool_calls import HermesToolCallParser, ParsedTurn, ToolCall

Message = dict[str, Any]
_MAX_RESULT_CHARS = 2000


# ------------------------------------------------------------------------------------------ schemas
def _schema(annotation: Any, where: str) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    if origin is Literal:
        values = list(typing.get_args(annotation))
        return {"enum": values}
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _schema(options[0], where)
        return {"anyOf": [_schema(a, where) for a in options]}
    if origin in (list, Sequence, tuple, set):
        inner = typing.get_args(annotation)
        return {"type": "array", **({"items": _schema(inner[0], where)} if inner else {})}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    simple = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array"}
    if annotation in simple:
        return {"type": simple[annotation]}
    raise TypeError(f"{where}: cannot describe type {annotation!r} in JSON schema")


def _check(value: Any, schema: dict[str, Any]) -> bool:
    """Does a JSON value fit the (subset of) schema that `_schema` writes?"""
    if "enum" in schema:
        return value in schema["enum"]
    if "anyOf" in schema:
        return any(_check(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list) and all(_check(v, schema.get("items", {})) for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def spec(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A `Tool` whose schema is read from `fn`'s type hints and whose description is its docstring."""
    hints = typing.get_type_hints(fn)
    name = name or fn.__name__
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args / **kwargs cannot be described; name each argument")
        properties[pname] = _schema(hints.get(pname, param.annotation), f"tool {name!r}, argument {pname!r}")
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            properties[pname]["default"] = param.default
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name, description, parameters, fn)


class ToolRegistry:
    """Named tools; `answer` runs the calls of one assistant turn and returns the `tool` messages."""

    def __init__(self, functions: Sequence[Callable[..., Any]] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for fn in functions:
            self.register(fn)

    def register(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Add `fn` (usable as a decorator); the name is the function's."""
        tool = tool_from_function(fn)
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self.tools[tool.name] = tool
        return fn

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools.values()]

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(result text, ok). Never raises on a bad call: the text says what was wrong."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r} (tools: {', '.join(self.tools) or 'none'})", False
        props, required = tool.parameters["properties"], tool.parameters["required"]
        unknown = sorted(set(arguments) - set(props))
        missing = [r for r in required if r not in arguments]
        if unknown or missing:
            parts = ([f"unknown argument(s) {', '.join(unknown)}"] if unknown else []) + (
                [f"missing argument(s) {', '.join(missing)}"] if missing else [])
            return f"error: {name}: {'; '.join(parts)}", False
        for key, value in arguments.items():
            if not _check(value, props[key]):
                return f"error: {name}: argument {key!r} has the wrong type ({type(value).__name__})", False
        try:
            result = tool.fn(**arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            return f"error: {name} raised {type(exc).__name__}: {exc}", False
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        return text[:_MAX_RESULT_CHARS], True

    def answer(self, turn: ParsedTurn | Message) -> list[Message]:
        """The `tool` messages answering one assistant turn: a `ParsedTurn`, or an assistant message with
        OpenAI `tool_calls` (and `tool_call_errors`, as the agent loop writes them)."""
        if isinstance(turn, ParsedTurn):
            calls = [(c.id, c.name, c.arguments) for c in turn.tool_calls]
            errors = turn.errors
        else:
            calls = []
            for c in turn.get("tool_calls") or []:
                fn = c.get("function", {})
                args = fn.get("arguments", {})
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    args = None
                calls.append((c.get("id", ""), fn.get("name", ""), args))
            errors = list(turn.get("tool_call_errors") or [])
        out: list[Message] = []
        for call_id, name, args in calls:
            text, _ = self.call(name, args) if isinstance(args, dict) else (f"error: {name}: bad arguments", False)
            out.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": text})
        out += [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in errors]
        return out


__all__ = ["HermesToolCallParser", "ParsedTurn", "Tool", "ToolCall", "ToolRegistry", "tool_from_function"]
