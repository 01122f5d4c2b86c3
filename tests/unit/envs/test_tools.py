"""Tools: JSON schema from signatures, tool-call parsing, malformed calls answered with errors (never raised)."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from tokenmill.envs.tools import HermesToolCallParser, ToolRegistry, tool_from_function
from tokenmill.rollout.agent import parse_turn


def lookup(city: str, units: Literal["c", "f"] = "c", days: list[int] | None = None, exact: bool = False) -> dict:
    """Weather for a city.

    Longer text that is not part of the description."""
    return {"city": city, "units": units, "days": days or [], "exact": exact}


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def test_schema_from_signature():
    spec = tool_from_function(lookup).spec()
    assert spec == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "units": {"enum": ["c", "f"], "default": "c"},
                    "days": {"type": "array", "items": {"type": "integer"}, "default": None},
                    "exact": {"type": "boolean", "default": False},
                },
                "required": ["city"],
            },
        },
    }


def test_undescribable_signatures_are_refused_at_registration():
    def star(*xs: int) -> int:
        return sum(xs)

    def obj(x: object) -> None:
        pass

    with pytest.raises(TypeError, match="star"):
        ToolRegistry([star])
    with pytest.raises(TypeError, match="argument 'x'"):
        ToolRegistry([obj])
    with pytest.raises(ValueError, match="registered already"):
        ToolRegistry([divide, divide])


def test_parser_reads_calls_and_reports_each_malformed_block():
    text = ('thinking <tool_call>{"name": "divide", "arguments": {"a": 6, "b": 3}}</tool_call>'
            '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
            '<tool_call>{"name": divide}</tool_call>'
            '<tool_call>[1, 2]</tool_call>'
            '<tool_call>{"name": "divide", "arguments": [1]}</tool_call>'
            'tail <tool_call>{"name": "divide"')
    turn = HermesToolCallParser().parse(text)
    assert [(c.name, c.arguments, c.id) for c in turn.tool_calls] == [
        ("divide", {"a": 6, "b": 3}, "call_0"), ("divide", {"a": 1, "b": 4}, "call_1")]
    assert turn.content == "thinking tail"
    assert len(turn.errors) == 4
    assert turn.errors[0].startswith("tool call 2: not JSON")
    assert turn.errors[1].startswith("tool call 3: expected")
    assert "arguments must be a JSON object" in turn.errors[2]
    assert turn.errors[3] == "tool call 5: no closing </tool_call>"
    openai = turn.tool_calls[0].openai()
    assert openai["type"] == "function" and json.loads(openai["function"]["arguments"]) == {"a": 6, "b": 3}


def test_registry_answers_good_and_bad_calls_with_tool_messages():
    tools = ToolRegistry([divide, lookup])
    text = ('<tool_call>{"name": "divide", "arguments": {"a": 7, "b": 2}}</tool_call>'
            '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
            '<tool_call>{"name": "divide", "arguments": {"a": "x", "b": 1}}</tool_call>'
            '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 1, "c": 2}}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo", "days": [1, 2]}}</tool_call>'
            '<tool_call>oops</tool_call>')
    # through the agent loop's message form (OpenAI tool_calls + tool_call_errors), as an environment sees it
    message = parse_turn(text, HermesToolCallParser().parse)
    try:
        divide(1, 0)
    except ZeroDivisionError as exc:  # the wording differs between Python versions
        zero_division = str(exc)
    answers = tools.answer(message)
    assert [a["content"] for a in answers] == [
        "3.5",
        f"error: divide raised ZeroDivisionError: {zero_division}",
        "error: divide: argument 'a' has the wrong type (str)",
        "error: divide: missing argument(s) b",
        "error: divide: unknown argument(s) c",
        "error: unknown tool 'rm' (tools: divide, lookup)",
        json.dumps({"city": "Oslo", "units": "c", "days": [1, 2], "exact": False}),
        "error: tool call 7: not JSON (Expecting value at column 1)",
    ]
    assert all(a["role"] == "tool" for a in answers)
    assert [a.get("tool_call_id") for a in answers[:7]] == [f"call_{i}" for i in range(7)]
    # the same answers from the parsed turn directly
    assert tools.answer(HermesToolCallParser().parse(text)) == answers


def test_bool_is_not_an_integer_and_ints_are_numbers():
    tools = ToolRegistry([divide])
    assert tools.call("divide", {"a": 3, "b": 2}) == ("1.5", True)
    assert tools.call("divide", {"a": True, "b": 2})[1] is False
