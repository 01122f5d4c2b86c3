"""Tool calls in model output: the Hermes / Qwen `<tool_call>{...}</tool_call>` format, read into OpenAI's
`tool_calls` shape. Wire format shared by the engine server (`tool_calls` in chat answers) and the
environments' tool registry (`tokenmill.envs.tools`), so it sits below both."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str

    def openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments as a JSON string, as the API sends them)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ParsedTurn:
    content: str  # the text outside the tool-call blocks
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per block that could not be read


class HermesToolCallParser:
    """Reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen format that
    many chat templates render tools in). An unterminated block counts as malformed."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn(content=self._block.sub("", text).strip())
        for n, found in enumerate(self._block.finditer(text)):
            body = found.group(1).strip()
            if not found.group(0).endswith(self.end):
                turn.errors.append(f"tool call {n}: no closing {self.end}")
                continue
            try:
                data = json.loads(body)
            except json.JSONDecodeError as exc:
                turn.errors.append(f"tool call {n}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                turn.errors.append(f'tool call {n}: expected {{"name": ..., "arguments": {{...}}}}')
                continue
            args = data.get("arguments", {})
            if isinstance(args, str):  # some models write the OpenAI wire form: arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            if not isinstance(args, dict):
                turn.errors.append(f"tool call {n} ({data['name']}): arguments must be a JSON object")
                continue
            turn.tool_calls.append(ToolCall(data["name"], args, f"call_{n}"))
        return turn
