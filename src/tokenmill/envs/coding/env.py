"""The coding environment: each assistant turn is a program, graded by the hidden tests in the sandbox.

Reward: the episode's return is the share of tests the *last* attempt passes. Each turn's reward is the
change in that share (`StepResult.reward` is summed over the episode by the trainer), so a one-attempt
episode gets exactly the share, and a policy gains nothing by holding back on its first attempt. `info`
carries the attempt's own `score`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import threading
from typing import Any

from tokenmill.envs.base import Message, StepResult
from tokenmill.envs.coding.harness import HARNESS, TestReport, cut, parse_report
from tokenmill.sandbox import Sandbox

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task by writing the requested function. Answer with the "
    "complete code in a single ```python code block; it is checked by hidden unit tests. Do not read input "
    "or print anything: only define the function (and any helpers it needs)."
)
FEEDBACK_CHARS = 1200  # the feedback message is cut to this many characters
STARTUP_S = 1.0  # sandbox wall-clock allowance beyond the test budget, for interpreter start-up


FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


def extract_code(text: str) -> tuple[str, bool]:
    """(code, fenced): the last fenced block, preferring Python-tagged or untagged ones (an unclosed last fence
    counts: the answer may have been cut at max_tokens); without any fence, the whole text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]
    if not blocks:
        return text, False
    python = [code for tag, code in blocks if tag in PYTHON_TAGS]
    return (python or [code for _, code in blocks])[-1], True


def message_text(message: Message) -> str:
    """The text of a message whose content is a string, None, or a list of OpenAI content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


_default_lock = threading.Lock()
_default_sandbox: Sandbox | None = None


def default_sandbox() -> Sandbox:
    """The process-wide sandbox every `CodingEnv` shares unless given one: isolation "auto", which raises
    `SandboxUnavailable` (with the fix) where no namespaced isolation works. It never falls back to running the
    code unconfined: that takes `CodingEnv(sandbox=Sandbox(isolation="none"))`, written out."""
    global _default_sandbox
    with _default_lock:
        if _default_sandbox is None:
            _default_sandbox = Sandbox(isolation="auto")
        return _default_sandbox


class CodingEnv:
    """One episode: the task row needs `prompt` (the problem) and `tests` (assert lines, as a list or a JSON
    string); `entry_point` (the function's name) improves the feedback.

    `timeout_s` bounds each attempt's tests (the sandbox gets `STARTUP_S` more to start Python), so a step
    takes at most about `timeout_s + STARTUP_S` seconds whatever the code does.
    """

    def __init__(self, sandbox: Sandbox | None = None, max_attempts: int = 2, timeout_s: float = 5.0) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.sandbox = sandbox if sandbox is not None else default_sandbox()
        self.max_attempts = max_attempts
        self.timeout_s = float(timeout_s)
        self.tests: list[str] = []
        self.entry_point: str | None = None
        self.attempts = 0
        self.score = 0.0
        self.done = False

    def reset(self, task: dict[str, Any]) -> list[Message]:
        tests = task["tests"]
        if isinstance(tests, str):
            tests = json.loads(tests)
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("task['tests'] must be a non-empty list of assert lines (or its JSON)")
        self.tests = list(tests)
        self.entry_point = task.get("entry_point") or None
        self.attempts, self.score, self.done = 0, 0.0, False
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(task["prompt"])}]

    def step(self, message: Message) -> StepResult:
        if self.done or not self.tests:
            return StepResult([], 0.0, True, {"error": "step() after the episode ended (or before reset())"})
        self.attempts += 1
        code, fenced = extract_code(message_text(message))
        info: dict[str, Any] = {"attempt": self.attempts, "total": len(self.tests), "fenced": fenced}
        if not code.strip():
            report = None
            feedback = "I found no code in your answer. Reply with the complete function in one ```python block."
            info.update(passed=0, isolation=None, timed_out=False)
        else:
            report = self.run_tests(code)
            feedback = self.feedback(report, fenced)
            info.update(passed=report.passed, isolation=self.sandbox.isolation, timed_out=report.timed_out)
        score = report.score if report is not None else 0.0
        reward, self.score = score - self.score, score
        self.done = score == 1.0 or self.attempts >= self.max_attempts
        info.update(score=score, solved=score == 1.0, feedback=feedback)
        observation = [] if self.done else [{"role": "user", "content": feedback}]
        return StepResult(observation, reward, self.done, info)

    def run_tests(self, code: str) -> TestReport:
        """Run `code` with this episode's tests in the sandbox."""
        nonce = secrets.token_hex(16)
        config = {"nonce": nonce, "budget": self.timeout_s, "entry_point": self.entry_point}
        limits = dataclasses.replace(
            self.sandbox.limits, cpu_seconds=self.timeout_s + 1.0, wall_seconds=self.timeout_s + STARTUP_S
        )
        result = self.sandbox.run_python(
            HARNESS,
            stdin=json.dumps(config),
            files={"solution.py": code, "tests.json": json.dumps(self.tests)},
            limits=limits,
        )
        return parse_report(result, nonce, self.tests, self.timeout_s)

    def feedback(self, report: TestReport, fenced: bool) -> str:
        """What the policy is told: the tally, a setup error if any, and the first failing test."""
        if report.syntax_error:
            hint = "" if fenced else " (I found no ```python code block, so I ran your whole answer)"
            return cut(f"Your code does not compile{hint}: {report.setup_error}.", FEEDBACK_CHARS)
        if report.passed == report.total:
            return f"All {report.total} tests passed."
        lines = [f"{report.passed} of {report.total} tests passed."]
        if report.setup_error:
            lines.append(f"Note: {report.setup_error}.")
        if report.first_failure:
            lines.append(f"First failing test: {report.first_failure}.")
        lines.append("Fix the code and answer with the complete corrected function in one ```python block.")
        return cut("\n".join(lines), FEEDBACK_CHARS)

    def close(self) -> None:
        pass


