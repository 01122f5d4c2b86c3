"""Arithmetic with a calculator tool: `a * b + c`-style problems whose numbers are too large to do in one's
head, so a policy needs several tool calls (one per operation) and then states the answer.

A turn with tool calls is answered with `tool` messages (results, or errors for malformed calls); a turn
without tool calls is the final answer, and the episode ends: reward 1 if its last integer is the true value.
`tool_cost` (default 0) is subtracted per call beyond the number of operations, to favour direct solutions.
"""

from __future__ import annotations

import operator
import random
import re
from typing import Any, Literal

from tokenmill.envs.base import Message, StepResult
from tokenmill.envs.tools import ToolRegistry

SYSTEM = ('Solve with the calculator: write <tool_call>{"name": "calc", "arguments": {"op": "mul", "a": 12, '
          '"b": 34}}</tool_call>, one call per operation, then answer with the number alone.')
_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


def calc(op: Literal["add", "sub", "mul"], a: int, b: int) -> int:
    """Apply one integer operation: add (a + b), sub (a - b) or mul (a * b)."""
    return _OPS[op](a, b)


class CalculatorEnv:
    """One problem per episode; the task row holds `expression` and `answer` (see `calculator_tasks`)."""

    def __init__(self, max_turns: int = 6, tool_cost: float = 0.0) -> None:
        self.tools = ToolRegistry([calc])
        self.max_turns = max_turns
        self.tool_cost = tool_cost
        self.answer = 0
        self.operations = 0
        self.turns = 0
        self.calls = 0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        self.answer, self.operations = int(task["answer"]), int(task["operations"])
        self.turns = self.calls = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["expression"]}]

    def step(self, message: Message) -> StepResult:
        self.turns += 1
        last_turn = self.turns >= self.max_turns
        if message.get("tool_calls") or message.get("tool_call_errors"):
            self.calls += len(message.get("tool_calls") or [])
            info = {"solved": False, "tool_calls": self.calls}
            return StepResult(self.tools.answer(message), 0.0, last_turn, info)
        numbers = re.findall(r"-?\d+", message.get("content") or "")
        solved = bool(numbers) and int(numbers[-1]) == self.answer
        extra = max(0, self.calls - self.operations)
        reward = (1.0 - self.tool_cost * extra) if solved else 0.0
        return StepResult([], reward, True, {"solved": solved, "tool_calls": self.calls})

    def close(self) -> None:
        pass


def calculator_problem(rng: random.Random, operations: int = 2, digits: int = 3) -> dict[str, Any]:
    """`operations` binary operations over (digits)-digit numbers, evaluated left to right as written
    with parentheses, e.g. '(417 * 382) + 905'."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    value = rng.randint(lo, hi)
    text = str(value)
    for i in range(operations):
        op = rng.choice(list(_OPS))
        operand = rng.randint(lo, hi)
        value = _OPS[op](value, operand)
        text = f"{text} {_SYMBOL[op]} {operand}" if i == 0 else f"({text}) {_SYMBOL[op]} {operand}"
    return {"prompt": text, "expression": text, "answer": value, "operations": operations}


def calculator_tasks(n: int, seed: int = 0, operations: int = 2, digits: int = 3):
    """`n` problems (a `datasets.Dataset`; `prompt` is the expression)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [calculator_problem(rng, operations, digits) for _ in range(n)]
    return Dataset.from_list(rows)
