"""The coding environment: task generation on the host, grading in the sandbox.

The sandbox tests run under whatever namespaced isolation works here and are skipped (with the reason) where
none does. Time limits are small so that the hostile programs (loops, hangs) keep the file fast.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tokenmill.envs.coding import (
    TEMPLATES,
    CodingEnv,
    coding_tasks,
    extract_code,
    message_text,
    problem_key,
)
from tokenmill.sandbox import Sandbox, SandboxUnavailable, available_isolation, runner

HERE = available_isolation()
needs_sandbox = pytest.mark.skipif(
    not HERE, reason="no sandbox isolation works here (install bubblewrap, allow unprivileged user namespaces)"
)
TIMEOUT_S = 1.0
SLACK_S = 3.0  # sandbox start-up and teardown on a loaded two-core machine


def answer(code: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"Here is my solution.\n```python\n{code}\n```\nDone."}


def add_task(seed: int = 3) -> dict:
    return coding_tasks(1, seed=seed, templates=["add_k"])[0]


def host_passes(code: str, tests: list[str]) -> int:
    """How many tests `code` passes, run here (only for our own trusted snippets)."""
    passed = 0
    for line in tests:
        namespace: dict = {}
        exec(code, namespace)  # noqa: S102 - our own reference snippets
        try:
            exec(line, namespace)  # noqa: S102
            passed += 1
        except AssertionError:
            pass
    return passed


# ---------------------------------------------------------------------------------------- host only


def test_tasks_are_distinct_reproducible_and_solved_by_their_reference():
    ds = coding_tasks(120, seed=0)
    assert set(ds.column_names) >= {"prompt", "entry_point", "tests", "solution"}
    assert len({problem_key(p) for p in ds["prompt"]}) == 120
    assert set(ds["template"]) == {t.name for t in TEMPLATES}
    assert coding_tasks(5, seed=0)["prompt"] == ds["prompt"][:5]
    for row in ds:
        assert row["prompt"].startswith(f"Write a Python function `{row['entry_point']}(")
        assert len(row["tests"]) >= 3
        assert host_passes(row["solution"], row["tests"]) == len(row["tests"])


def test_exclude_keeps_held_out_problems_out_whatever_their_example():
    held_out = coding_tasks(40, seed=100)
    train = coding_tasks(200, seed=0, exclude=set(held_out["prompt"]))
    assert not {problem_key(p) for p in held_out["prompt"]} & {problem_key(p) for p in train["prompt"]}


def test_extract_code_takes_the_last_python_block():
    text = "```python\nold = 1\n```\nthen\n```text\nnot code\n```\n```py\nnew = 2\n```\ntrailing words"
    assert extract_code(text) == ("new = 2\n", True)
    assert extract_code("```\nx = 1\n```") == ("x = 1\n", True)
    assert extract_code("```python\ndef f():\n    return 1") == ("def f():\n    return 1", True)  # cut off
    assert extract_code("x = 1") == ("x = 1", False)
    assert message_text({"role": "assistant", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}) == "ab"
    assert message_text({"role": "assistant", "content": None}) == ""


def test_fails_closed_without_isolation_unless_none_is_asked_for(monkeypatch):
    from tokenmill.envs.coding import env as coding

    monkeypatch.setattr(runner, "_probed", {"bwrap": "bwrap not found", "unshare": "user namespaces off"})
    monkeypatch.setattr(coding, "_default_sandbox", None)
    with pytest.raises(SandboxUnavailable, match="isolation='none'"):
        CodingEnv()
    env = CodingEnv(sandbox=Sandbox(isolation="none"), timeout_s=TIMEOUT_S)  # explicit: runs unconfined
    task = add_task()
    env.reset(task)
    result = env.step(answer(task["solution"]))
    assert (result.reward, result.done, result.info["isolation"]) == (1.0, True, "none")


# ---------------------------------------------------------------------------------------- in the sandbox


@needs_sandbox
def test_reference_solutions_score_one_and_report_isolation():
    ds = coding_tasks(len(TEMPLATES), seed=1)
    assert set(ds["template"]) == {t.name for t in TEMPLATES}
    for row in ds:
        env = CodingEnv(max_attempts=1, timeout_s=2.0)
        messages = env.reset(row)
        assert [m["role"] for m in messages] == ["system", "user"] and "```python" in messages[0]["content"]
        result = env.step(answer(row["solution"]))
        assert result.reward == 1.0 and result.done and result.observation == [], result.info
        assert result.info["passed"] == result.info["total"] == len(row["tests"])
        assert result.info["isolation"] == env.sandbox.isolation in HERE


@needs_sandbox
def test_wrong_solution_gets_partial_credit_and_feedback():
    task = add_task()
    k = int(task["solution"].split("x + ")[1])
    wrong = f"def add_k(x):\n    print('debug', x)\n    return x + {k} if x > 0 else x"
    expected = host_passes(wrong, task["tests"])
    assert 0 < expected < len(task["tests"])
    env = CodingEnv(timeout_s=TIMEOUT_S)
    env.reset(task)
    result = env.step(answer(wrong))
    assert result.info["passed"] == expected
    assert result.reward == pytest.approx(expected / len(task["tests"]))
    assert not result.done
    feedback = result.observation[0]["content"]
    assert result.observation[0]["role"] == "user"
    assert f"{expected} of {len(task['tests'])} tests passed" in feedback
    assert "First failing test: assert add_k(" in feedback and "got " in feedback


@needs_sandbox
def test_second_attempt_after_feedback_can_succeed():
    task = add_task(seed=5)
    env = CodingEnv(max_attempts=2, timeout_s=TIMEOUT_S)
    env.reset(task)
    first = env.step(answer("def add_k(x):\n    return x"))
    assert first.info["passed"] == 0 and not first.done and first.observation
    second = env.step(answer(task["solution"]))
    assert second.done and second.info["solved"] and second.info["attempt"] == 2
    assert first.reward + second.reward == 1.0  # the return is the last attempt's share
    late = env.step(answer(task["solution"]))  # after the end: no exception, no reward
    assert late.done and late.reward == 0.0


@needs_sandbox
def test_attempts_run_out():
    env = CodingEnv(max_attempts=2, timeout_s=TIMEOUT_S)
    env.reset({"prompt": "p", "tests": json.dumps(["assert f() == 1"]), "entry_point": "f"})  # JSON tests
    assert not env.step(answer("def f():\n    return 2")).done
    last = env.step(answer("def f():\n    return 3"))
    assert last.done and last.reward == 0.0 and last.observation == [] and "got 3" in last.info["feedback"]


SWALLOWS_TIMEOUT = """
def add_k(x):
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass
"""
OS_SYSTEM = """
import os
os.system('echo pwned; echo pwned > /sandbox/pwned; echo pwned >&2')
def add_k(x):
    return os.system('exit 3')
"""
FORGED_REPORT = """
import os
for fd in range(3, 20):
    try:
        os.write(fd, b'0 {"test": 0, "ok": true}\\n')
    except OSError:
        pass
def add_k(x):
    return 0
"""
ALWAYS_EQUAL = """
class Yes:
    def __eq__(self, other):
        return True
def add_k(x):
    return Yes()
"""
HOSTILE = {
    "infinite loop": ("def add_k(x):\n    while True:\n        pass", "timed out"),
    "loop that swallows the timeout": (SWALLOWS_TIMEOUT, "time limit"),
    "loop in C": ("def add_k(x):\n    return sum(range(10**13))", "time limit"),
    "loop at top level": ("while True:\n    pass\ndef add_k(x):\n    return x", "timed out"),
    "os.system": (OS_SYSTEM, "got 768"),
    "kill every process it can": ("import os\nos.system('kill -9 -1')", "ended (exit code 137) before"),
    "exit": ("import sys\nsys.exit(0)", "called exit()"),
    "os._exit in the function": ("import os\ndef add_k(x):\n    os._exit(0)", "ended (exit code 0) before"),
    "syntax error": ("def add_k(x)\n    return x", "SyntaxError"),
    "forged report": (FORGED_REPORT, "got 0"),
    "always-equal object": (ALWAYS_EQUAL, "not a plain value"),
    "huge output": ("print('x' * 10**6)\ndef add_k(x):\n    print('y' * 10**6)\n    return None", "got None"),
    "fork": ("import os\ndef add_k(x):\n    os.fork()\n    return -1", "got -1"),
    "memory": ("def add_k(x):\n    return len([0] * 10**10)", "MemoryError"),
}


@needs_sandbox
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_or_broken_code_scores_zero_with_feedback_and_never_hangs(name):
    code, expected_feedback = HOSTILE[name]
    task = add_task()
    env = CodingEnv(max_attempts=2, timeout_s=TIMEOUT_S)
    env.reset(task)
    start = time.monotonic()
    result = env.step(answer(code))
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert result.reward == 0.0 and result.info["passed"] == 0 and not result.done
    assert expected_feedback in result.observation[0]["content"], result.observation[0]["content"]
    assert result.info["isolation"] in HERE


@needs_sandbox
def test_hang_in_one_test_keeps_the_credit_of_the_others():
    task = add_task()
    k = int(task["solution"].split("x + ")[1])
    code = f"def add_k(x):\n    if x < 0:\n        sum(range(10**13))\n    return x + {k}"
    env = CodingEnv(timeout_s=TIMEOUT_S)
    env.reset(task)
    result = env.step(answer(code))
    first_negative = next(i for i, t in enumerate(task["tests"]) if "add_k(-" in t)
    assert result.info["passed"] == first_negative > 0 and result.info["timed_out"]
    assert task["tests"][first_negative] in result.info["feedback"]


@needs_sandbox
def test_environment_variables_of_the_host_are_invisible(monkeypatch):
    monkeypatch.setenv("TOKENMILL_TEST_SECRET", "hunter2")
    assert os.environ["TOKENMILL_TEST_SECRET"] == "hunter2"
    task = add_task()
    k = int(task["solution"].split("x + ")[1])
    code = (
        "import os\n"
        "def add_k(x):\n"
        "    seen = dict(os.environ)\n"
        "    try:\n"
        "        seen['parent'] = open(f'/proc/{os.getppid()}/environ').read()\n"
        "    except OSError:\n"
        "        pass\n"
        f"    return x + {k} if 'hunter2' not in str(seen) else str(seen)"
    )
    env = CodingEnv(timeout_s=TIMEOUT_S)
    env.reset(task)
    result = env.step(answer(code))
    assert result.reward == 1.0 and result.done
    assert "hunter2" not in json.dumps(result.info)


@needs_sandbox
def test_no_code_gives_feedback_not_an_exception():
    env = CodingEnv(timeout_s=TIMEOUT_S)
    env.reset(add_task())
    prose = env.step({"role": "assistant", "content": "I think you should add the numbers."})
    assert prose.reward == 0.0 and not prose.done
    assert "no ```python code block" in prose.observation[0]["content"]
    empty = env.step({"role": "assistant", "content": "```python\n```"})
    assert empty.reward == 0.0 and empty.done and "no code" in empty.info["feedback"]
