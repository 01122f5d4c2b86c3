"""Write a Python function, get graded by hidden unit tests run in the sandbox.

An episode is one small function-writing problem (see `coding_tasks`). Each assistant turn is a program: the
last fenced code block of the message (or the whole message when it has no fence). It runs in
`tokenmill.sandbox` together with a harness that executes the hidden `assert` lines one by one, so a wrong
solution earns partial credit, and a failed attempt is answered with the first failing test as feedback,
until all tests pass or `max_attempts` are used up.

Why a harness instead of appending the asserts to the program: the first failing assert would end the run,
so "7 of 8 right" and "nothing right" would look the same; the model's prints would mix with the verdict;
and a program that loops or calls `exit()` would take the verdict with it. The harness reports each test on a
channel of its own (a private copy of stdout, each line tagged with a per-run nonce, written as soon as the
test ends) and gives every test a slice of the time budget, so a loop costs only that test.

Reward: the episode's return is the share of tests the *last* attempt passes. Each turn's reward is the
change in that share (`StepResult.reward` is summed over the episode by the trainer), so a one-attempt
episode gets exactly the share, and a policy gains nothing by holding back on its first attempt. `info`
carries the attempt's own `score`.

What the harness guards against is accident and the obvious tricks, not a determined adversary inside the
same process: it checks `assert f(...) == <literal>` tests structurally (the result must be made of plain
built-in values, so an object whose `__eq__` always says True fails), ignores lines forged without the
nonce, stops a forked child from reporting, and takes stdin away before the program runs. The sandbox, not
the harness, is the security boundary for the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import secrets
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.envs.base import Message, StepResult
from tokenmill.sandbox import RunResult, Sandbox

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task by writing the requested function. Answer with the "
    "complete code in a single ```python code block; it is checked by hidden unit tests. Do not read input "
    "or print anything: only define the function (and any helpers it needs)."
)
FEEDBACK_CHARS = 1200  # the feedback message is cut to this many characters
MESSAGE_CHARS = 400  # each error or value shown in feedback is cut to this many characters
STARTUP_S = 1.0  # sandbox wall-clock allowance beyond the test budget, for interpreter start-up

# --------------------------------------------------------------------------------------------- harness

# Runs inside the sandbox on the system interpreter (stdlib only). Reads its config (nonce, time budget,
# entry point) from stdin, the program from solution.py and the asserts from tests.json.
HARNESS = r'''
import ast, builtins, io, json, math, os, signal, sys, traceback

PLAIN = (int, float, complex, str, bytes, bool, type(None))
CONTAINERS = (list, tuple, set, frozenset)


class _Timeout(BaseException):
    """BaseException, so that `except Exception:` in the program does not swallow it."""


class _Sink(io.TextIOBase):
    def writable(self):
        return True

    def write(self, text):
        return len(text)


def _alarm(signum, frame):
    raise _Timeout()


def _cut(text, limit=__MESSAGE_CHARS__):
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value, depth=0):
    """Made only of built-in values, so that comparing it runs no code of the program."""
    if depth > 50:
        return False
    kind = type(value)
    if kind in PLAIN:
        return True
    if kind in CONTAINERS:
        return all(_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _equal(value, expected):
    if isinstance(expected, float) and type(value) in (int, float):
        return math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-9)
    return bool(value == expected)


def _error(exc):
    """What went wrong, as "it raised Type: message (line N of your code)", N from the traceback."""
    try:
        if isinstance(exc, _Timeout):
            return "it timed out (too slow or an infinite loop)"
        if isinstance(exc, SystemExit):
            return "it called exit()"
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "solution.py"]
        return "it raised " + _cut(text + (" (line %d of your code)" % lines[-1] if lines else ""))
    except BaseException:
        return "it raised an exception that cannot be shown"


def _show(value):
    try:
        return _cut(repr(value))
    except BaseException:  # e.g. an int too long to print
        return "a value of type %s that cannot be shown" % type(value).__name__


def _literal_check(line):
    """For `assert <expr> == <literal>`: the expression's code and the literal; else None."""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    try:
        expected = ast.literal_eval(test.comparators[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return compile(ast.Expression(test.left), "<test>", "eval"), expected


def main():
    config = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDWR)
    report_fd, error_fd = os.dup(1), os.dup(2)  # non-inheritable: the program's subprocesses do not get them
    for fd in (0, 1, 2):  # the program may not re-read the nonce, nor write to our channel
        os.dup2(null, fd)
    os.close(null)
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(""), _Sink(), _Sink()
    nonce, pid = config["nonce"], os.getpid()

    def report(record):
        if os.getpid() != pid:  # a child the program forked must not report (nor run on)
            os._exit(0)
        os.write(report_fd, (nonce + " " + json.dumps(record) + "\n").encode())

    try:
        run(config, report)
    except BaseException:
        os.write(error_fd, traceback.format_exc().encode())
        os._exit(1)
    os._exit(0)


def run(config, report):
    import time

    signal.signal(signal.SIGALRM, _alarm)
    deadline = time.monotonic() + config["budget"]
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    with open("solution.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    units = len(tests) + 1  # the program's own top level, then each test

    def timed(fn):
        """Run fn() with an equal share of what is left of the budget; (ok, value or exception)."""
        share = max((deadline - time.monotonic()) / units, 0.05)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, share)
                return True, fn()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:  # noqa: anything the program raises, exit() and our timeout included
            return False, exc

    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        report({"setup": _cut("SyntaxError: %s (line %s)" % (exc.msg, exc.lineno))
                if isinstance(exc, SyntaxError) else "it does not compile: " + _error(exc), "syntax": True})
        return
    namespace = {"__name__": "solution", "__builtins__": builtins}
    ok, exc = timed(lambda: exec(code, namespace))
    units -= 1
    if not ok:
        report({"setup": "running your code failed: " + _error(exc)})
    entry = config.get("entry_point")
    if entry and not callable(namespace.get(entry)):
        report({"setup": "your code does not define a function `%s`" % entry})
    for i, line in enumerate(tests):
        check = _literal_check(line)
        if check is None:
            ok, exc = timed(lambda: exec(compile(line, "<test>", "exec"), namespace))
            message = None if ok else _cut(line) + (
                " failed" if isinstance(exc, AssertionError) else " failed: " + _error(exc))
        else:
            expr, expected = check
            ok, value = timed(lambda: eval(expr, namespace))
            if not ok:
                message = _cut(line) + " failed: " + _error(value)
            elif not _plain(value):
                ok, message = False, _cut(line) + " failed: got an object of type %s, not a plain value" % (
                    _cut(getattr(type(value), "__name__", "?"), 60))
            else:
                ok = _equal(value, expected)
                message = None if ok else _cut(line) + " failed: got " + _show(value)
        units -= 1
        report({"test": i, "ok": ok, "message": message})
    report({"done": True})


main()
'''.replace("__MESSAGE_CHARS__", str(MESSAGE_CHARS))


@dataclass(frozen=True)
class TestReport:
    """What the harness said about one run: which tests passed, and why the first failure failed."""

    passed: int
    total: int
    setup_error: str | None  # syntax error, top-level exception, missing entry point
    syntax_error: bool
    first_failure: str | None
    timed_out: bool
    finished: bool  # the harness got to the end (no crash, no kill)

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def parse_report(result: RunResult, nonce: str, tests: Sequence[str], timeout_s: float) -> TestReport:
    """Read the nonce-tagged lines the harness wrote; tests it never reported count as failed, and the first of
    those is blamed on the timeout or the crash that stopped it."""
    total = len(tests)
    outcomes: dict[int, tuple[bool, str | None]] = {}
    setup: list[str] = []
    syntax = finished = False
    for line in result.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        try:
            record = json.loads(line[len(nonce) + 1:])
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if "setup" in record:
            setup.append(str(record["setup"]))
            syntax = syntax or bool(record.get("syntax"))
        elif "test" in record and isinstance(record["test"], int) and 0 <= record["test"] < total:
            outcomes.setdefault(record["test"], (record.get("ok") is True, record.get("message")))
        elif record.get("done") is True:
            finished = True
    first_failure = None
    for i in range(total):
        ok, message = outcomes.get(i, (False, None))
        if ok:
            continue
        if message is None and i not in outcomes:
            if syntax:
                break
            if result.timed_out:
                message = f"{_cut(tests[i], MESSAGE_CHARS)} was stopped when the time limit ({timeout_s:g}s) ran out"
            else:
                code = result.returncode
                message = f"your program ended (exit code {code}) before {_cut(tests[i], MESSAGE_CHARS)} ran"
        first_failure = message
        break
    return TestReport(
        passed=sum(ok for ok, _ in outcomes.values()),
        total=total,
        setup_error="; ".join(setup) or None,
        syntax_error=syntax,
        first_failure=first_failure,
        timed_out=result.timed_out,
        finished=finished,
    )


# --------------------------------------------------------------------------------------------- parsing

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


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------- sandbox

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


# --------------------------------------------------------------------------------------------- environment


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
            return _cut(f"Your code does not compile{hint}: {report.setup_error}.", FEEDBACK_CHARS)
        if report.passed == report.total:
            return f"All {report.total} tests passed."
        lines = [f"{report.passed} of {report.total} tests passed."]
        if report.setup_error:
            lines.append(f"Note: {report.setup_error}.")
        if report.first_failure:
            lines.append(f"First failing test: {report.first_failure}.")
        lines.append("Fix the code and answer with the complete corrected function in one ```python block.")
        return _cut("\n".join(lines), FEEDBACK_CHARS)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------- tasks

Args = tuple[Any, ...]


@dataclass(frozen=True)
class Problem:
    """One drawn problem: `statement` completes "Write `f(...)` that ...", `solution` is a reference program,
    `reference` computes expected values here on the host (our code, not the model's), `inputs` are argument
    tuples (the first becomes the prompt's example, the rest the hidden tests)."""

    statement: str
    solution: str
    reference: Callable[..., Any]
    inputs: list[Args]


@dataclass(frozen=True)
class Template:
    """A family of problems: `make(rng)` draws the constants."""

    name: str
    params: str
    make: Callable[[random.Random], Problem]


def _ints(rng: random.Random, k: int, lo: int = -50, hi: int = 50) -> list[Args]:
    return [(rng.randint(lo, hi),) for _ in range(k)]


def _words(rng: random.Random, k: int, alphabet: str, lo: int = 0, hi: int = 10) -> list[Args]:
    return [("".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi))),) for _ in range(k)]


def _lists(rng: random.Random, k: int, lo: int = -20, hi: int = 20, size: tuple[int, int] = (0, 8)) -> list[Args]:
    return [([rng.randint(lo, hi) for _ in range(rng.randint(*size))],) for _ in range(k)]


def _letter_soup(rng: random.Random, c: str) -> str:
    """An alphabet in which `c` is common, so the strings drawn from it hold it a few times."""
    return c * 3 + "".join(rng.sample(string.ascii_lowercase, 4))


def _add_k(rng: random.Random) -> Problem:
    k = rng.choice([i for i in range(-20, 21) if i])
    return Problem(
        statement=f"returns x + {k}" if k > 0 else f"returns x - {-k}",
        solution=f"def add_k(x):\n    return x + {k}\n",
        reference=lambda x: x + k,
        inputs=[(rng.randint(1, 9),), (0,), *_ints(rng, 5)],
    )


def _scale(rng: random.Random) -> Problem:
    k = rng.randint(2, 12)
    return Problem(
        statement=f"returns x multiplied by {k}",
        solution=f"def scale(x):\n    return x * {k}\n",
        reference=lambda x: x * k,
        inputs=[(rng.randint(2, 9),), (0,), (1,), *_ints(rng, 4)],
    )


def _count_char(rng: random.Random) -> Problem:
    c = rng.choice(string.ascii_lowercase)
    soup = _letter_soup(rng, c)
    return Problem(
        statement=f"returns how many times the letter '{c}' occurs in the string s (case-sensitive)",
        solution=f"def count_char(s):\n    return s.count({c!r})\n",
        reference=lambda s: s.count(c),
        inputs=[*_words(rng, 1, soup, 3, 6), ("",), (c.upper() + c,), *_words(rng, 5, soup, 1, 12)],
    )


def _clip(rng: random.Random) -> Problem:
    lo = rng.randint(-10, 10)
    hi = lo + rng.randint(1, 20)
    return Problem(
        statement=f"returns x clipped to the range [{lo}, {hi}]: {lo} if x < {lo}, {hi} if x > {hi}, else x",
        solution=f"def clip(x):\n    return min(max(x, {lo}), {hi})\n",
        reference=lambda x: min(max(x, lo), hi),
        inputs=[(hi + rng.randint(1, 30),), (lo,), (hi,), (lo - rng.randint(1, 30),),
                (hi + rng.randint(1, 30),), (rng.randint(lo, hi),)],
    )


def _reverse_string(rng: random.Random) -> Problem:
    case = rng.choice(["", "upper", "lower"])
    method = f".{case}()" if case else ""
    return Problem(
        statement="returns the string s reversed" + (f", in {case} case" if case else ""),
        solution=f"def reverse_string(s):\n    return s[::-1]{method}\n",
        reference=lambda s: getattr(s[::-1], case)() if case else s[::-1],
        inputs=[*_words(rng, 1, string.ascii_letters, 3, 6), ("",), *_words(rng, 5, string.ascii_letters, 1, 10)],
    )


def _rotate_left(rng: random.Random) -> Problem:
    k = rng.randint(1, 5)
    return Problem(
        statement=(f"returns the string s rotated left by {k} characters, wrapping around (so a rotation by "
                   "len(s) leaves s unchanged); the empty string stays empty"),
        solution=(f"def rotate_left(s):\n    if not s:\n        return s\n    k = {k} % len(s)\n"
                  "    return s[k:] + s[:k]\n"),
        reference=lambda s: s[k % len(s):] + s[:k % len(s)] if s else s,
        inputs=[*_words(rng, 1, string.ascii_lowercase, 6, 8), ("",), ("a",),
                *_words(rng, 5, string.ascii_lowercase, 2, 10)],
    )


def _kth_largest(rng: random.Random) -> Problem:
    k = rng.randint(1, 3)
    nth = {1: "largest", 2: "second largest", 3: "third largest"}[k]
    return Problem(
        statement=(f"returns the {nth} element of the list xs, counting repeated values separately "
                   f"(xs has at least {k} elements)"),
        solution=f"def kth_largest(xs):\n    return sorted(xs, reverse=True)[{k - 1}]\n",
        reference=lambda xs: sorted(xs, reverse=True)[k - 1],
        inputs=_lists(rng, 7, size=(k, 9)),
    )


def _sum_multiples(rng: random.Random) -> Problem:
    k = rng.randint(2, 9)
    return Problem(
        statement=f"returns the sum of the non-negative integers below n that are multiples of {k} (n >= 0)",
        solution=f"def sum_multiples(n):\n    return sum(i for i in range(n) if i % {k} == 0)\n",
        reference=lambda n: sum(i for i in range(n) if i % k == 0),
        inputs=[(rng.randint(10, 30),), (0,), (1,), *_ints(rng, 4, 2, 100)],
    )


def _is_multiple(rng: random.Random) -> Problem:
    k = rng.randint(2, 13)
    return Problem(
        statement=f"returns True if the integer x is divisible by {k}, else False",
        solution=f"def is_multiple(x):\n    return x % {k} == 0\n",
        reference=lambda x: x % k == 0,
        inputs=[(k * rng.randint(2, 5),), (0,), (k * rng.randint(1, 9),), (-k * rng.randint(1, 9),),
                (k * rng.randint(1, 9) + rng.randint(1, k - 1),), *_ints(rng, 2, -100, 100)],
    )


def _repeat_string(rng: random.Random) -> Problem:
    k, sep = rng.randint(2, 4), rng.choice(["-", ",", " ", "+", ""])
    return Problem(
        statement=f"returns {k} copies of the string s joined by {sep!r}",
        solution=f"def repeat_string(s):\n    return {sep!r}.join([s] * {k})\n",
        reference=lambda s: sep.join([s] * k),
        inputs=[*_words(rng, 1, string.ascii_lowercase, 2, 3), ("",), *_words(rng, 4, string.ascii_lowercase, 1, 5)],
    )


def _count_greater(rng: random.Random) -> Problem:
    t = rng.randint(-10, 10)
    return Problem(
        statement=f"returns how many elements of the list xs are greater than {t}",
        solution=f"def count_greater(xs):\n    return sum(1 for x in xs if x > {t})\n",
        reference=lambda xs: sum(1 for x in xs if x > t),
        inputs=[*_lists(rng, 1, size=(3, 5)), ([],), ([t, t + 1],), *_lists(rng, 4)],
    )


def _index_of(rng: random.Random) -> Problem:
    v = rng.randint(0, 9)
    lists = [([rng.randint(0, 9) for _ in range(rng.randint(1, 8))],) for _ in range(4)]
    return Problem(
        statement=f"returns the index of the first occurrence of {v} in the list xs, or -1 if {v} is not in xs",
        solution=f"def index_of(xs):\n    return xs.index({v}) if {v} in xs else -1\n",
        reference=lambda xs: xs.index(v) if v in xs else -1,
        inputs=[([rng.randint(0, 9), v, rng.randint(0, 9)],), ([],), ([v, v],), *lists],
    )


def _remove_char(rng: random.Random) -> Problem:
    c = rng.choice(string.ascii_lowercase)
    soup = _letter_soup(rng, c)
    return Problem(
        statement=f"returns the string s with every '{c}' removed (other characters unchanged)",
        solution=f"def remove_char(s):\n    return s.replace({c!r}, '')\n",
        reference=lambda s: s.replace(c, ""),
        inputs=[*_words(rng, 1, soup, 4, 6), ("",), *_words(rng, 5, soup, 1, 12)],
    )


def _poly(rng: random.Random) -> Problem:
    a, b, c = rng.randint(1, 5), rng.randint(-9, 9), rng.randint(-9, 9)
    return Problem(
        statement=f"returns {a}*x**2 + ({b})*x + ({c}) for an integer x",
        solution=f"def poly(x):\n    return {a} * x * x + {b} * x + {c}\n",
        reference=lambda x: a * x * x + b * x + c,
        inputs=[(2,), (0,), *_ints(rng, 5, -10, 10)],
    )


def _fizz(rng: random.Random) -> Problem:
    a, b = rng.sample(range(2, 8), 2)

    def reference(n: int) -> str:
        return "FizzBuzz" if n % a == 0 and n % b == 0 else "Fizz" if n % a == 0 else "Buzz" if n % b == 0 else str(n)

    return Problem(
        statement=(f"returns 'FizzBuzz' if n is divisible by both {a} and {b}, 'Fizz' if only by {a}, "
                   f"'Buzz' if only by {b}, and otherwise str(n)"),
        solution=(f"def fizz(n):\n    if n % {a} == 0 and n % {b} == 0:\n        return 'FizzBuzz'\n"
                  f"    if n % {a} == 0:\n        return 'Fizz'\n    if n % {b} == 0:\n        return 'Buzz'\n"
                  "    return str(n)\n"),
        reference=reference,
        inputs=[(a,), (a * b,), (b,), (1,), (2 * a * b,), *_ints(rng, 2, 1, 100)],
    )


def _digit_sum(rng: random.Random) -> Problem:
    m = rng.randint(3, 11)
    return Problem(
        statement=f"returns the sum of the decimal digits of the integer n >= 0, modulo {m}",
        solution=f"def digit_sum(n):\n    return sum(int(d) for d in str(n)) % {m}\n",
        reference=lambda n: sum(int(d) for d in str(n)) % m,
        inputs=[(rng.randint(100, 999),), (0,), *_ints(rng, 5, 1, 10**6)],
    )


def _caesar(rng: random.Random) -> Problem:
    k = rng.randint(1, 25)

    def reference(s: str) -> str:
        return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)

    return Problem(
        statement=(f"returns s with every lowercase letter a-z shifted {k} places forward in the alphabet, "
                   "wrapping from z back to a; all other characters stay as they are"),
        solution=(f"def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' "
                  "else c for c in s)\n"),
        reference=reference,
        inputs=[("abc",), ("",), ("xyz",), *_words(rng, 4, string.ascii_lowercase + " A!", 1, 10)],
    )


def _keep_multiples(rng: random.Random) -> Problem:
    k = rng.randint(2, 6)
    return Problem(
        statement=f"returns a new list of the elements of xs that are divisible by {k}, in their original order",
        solution=f"def keep_multiples(xs):\n    return [x for x in xs if x % {k} == 0]\n",
        reference=lambda xs: [x for x in xs if x % k == 0],
        inputs=[([1, 2, 3, 4, 5, 6, k * 3],), ([],), *_lists(rng, 5)],
    )


TEMPLATES: tuple[Template, ...] = (
    Template("add_k", "x", _add_k),
    Template("scale", "x", _scale),
    Template("count_char", "s", _count_char),
    Template("clip", "x", _clip),
    Template("reverse_string", "s", _reverse_string),
    Template("rotate_left", "s", _rotate_left),
    Template("kth_largest", "xs", _kth_largest),
    Template("sum_multiples", "n", _sum_multiples),
    Template("is_multiple", "x", _is_multiple),
    Template("repeat_string", "s", _repeat_string),
    Template("count_greater", "xs", _count_greater),
    Template("index_of", "xs", _index_of),
    Template("remove_char", "s", _remove_char),
    Template("poly", "x", _poly),
    Template("fizz", "n", _fizz),
    Template("digit_sum", "n", _digit_sum),
    Template("caesar", "s", _caesar),
    Template("keep_multiples", "xs", _keep_multiples),
)


def _call(name: str, args: Sequence[Any]) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def make_task(template: Template, rng: random.Random) -> dict[str, Any]:
    """One task row from `template`: the prompt shows the first input as an example; the tests use the others."""
    problem = template.make(rng)
    inputs = list({repr(args): args for args in problem.inputs}.values())  # distinct, in order
    example, *hidden = inputs
    call = functools.partial(_call, template.name)
    prompt = (
        f"Write a Python function `{template.name}({template.params})` that {problem.statement}.\n\n"
        f"Example: {call(example)} == {problem.reference(*example)!r}"
    )
    tests = [f"assert {call(args)} == {problem.reference(*args)!r}" for args in hidden]
    return {"prompt": prompt, "entry_point": template.name, "tests": tests, "solution": problem.solution,
            "template": template.name}


def problem_key(prompt: str) -> str:
    """What makes two prompts the same problem: the statement line, without the example (which is drawn
    afresh each time), so a held-out problem stays out of training whatever its example."""
    return prompt.split("\n", 1)[0]


def coding_tasks(n: int, seed: int = 0, exclude: set[str] | None = None, templates: Sequence[str] | None = None):
    """`n` function-writing problems with hidden unit tests: the templates in turn (each round shuffled), with
    random constants, so about 2,500 distinct problems (families with few constants, like `reverse_string`,
    recur only once everything else is used up); `exclude` holds prompts of problems to leave out (a held-out
    split; see `problem_key`), `templates` limits the families by name.

    Columns: prompt (the problem statement, with one example), entry_point, tests (assert lines), solution (a
    reference program, for warm starts and tests), template.
    """
    from datasets import Dataset

    chosen = [t for t in TEMPLATES if templates is None or t.name in templates]
    if not chosen:
        raise ValueError(f"no template among {templates!r}; known: {[t.name for t in TEMPLATES]}")
    rng = random.Random(seed)
    banned, seen = {problem_key(p) for p in exclude or ()}, set()
    rows: dict[str, list[Any]] = {"prompt": [], "entry_point": [], "tests": [], "solution": [], "template": []}
    attempts = 0
    order: list[Template] = []
    while len(rows["prompt"]) < n:
        if not order:
            order = rng.sample(chosen, len(chosen))
        task = make_task(order.pop(), rng)
        key = problem_key(task["prompt"])
        attempts += 1
        if attempts > 1000 * (n + 10):
            raise ValueError("could not draw enough problems outside `exclude`")
        # held-out problems never appear; repeats only once the space is nearly exhausted
        if key in banned or (key in seen and attempts < 50 * n):
            continue
        seen.add(key)
        for column, values in rows.items():
            values.append(task[column])
    return Dataset.from_dict(rows)
