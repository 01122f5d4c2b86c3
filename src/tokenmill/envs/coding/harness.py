"""The test harness: a stdlib-only program run inside the sandbox next to the model's code, and the parsing of
what it reports.

The harness executes the hidden `assert` lines one by one, each with a slice of the time budget, and writes
each verdict as soon as the test ends on a private copy of stdout, every line tagged with a per-run nonce.
So "7 of 8 right" differs from "nothing right", the model's prints cannot mix with the verdict, and a program
that loops or calls `exit()` costs only the test it was in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.sandbox import RunResult

MESSAGE_CHARS = 400  # each error or value shown in feedback is cut to this many characters

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
                message = f"{cut(tests[i], MESSAGE_CHARS)} was stopped when the time limit ({timeout_s:g}s) ran out"
            else:
                code = result.returncode
                message = f"your program ended (exit code {code}) before {cut(tests[i], MESSAGE_CHARS)} ran"
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


def cut(text: str, limit: int) -> str:
    """`text`, shortened to `limit` characters with a trailing '...' when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
