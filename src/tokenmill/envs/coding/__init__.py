"""Write a Python function, get graded by hidden unit tests run in the sandbox (the `coding` environment).

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

The package: `env` (the environment, the code extraction and the shared sandbox), `harness` (the program that
runs the tests inside the sandbox, and the parsing of what it reports), `problems` (the problem templates and
`coding_tasks`).
"""

from tokenmill.envs.coding.env import CodingEnv, default_sandbox, extract_code, message_text
from tokenmill.envs.coding.harness import TestReport, parse_report
from tokenmill.envs.coding.problems import TEMPLATES, Problem, Template, coding_tasks, make_task, problem_key

__all__ = [
    "TEMPLATES",
    "CodingEnv",
    "Problem",
    "Template",
    "TestReport",
    "coding_tasks",
    "default_sandbox",
    "extract_code",
    "make_task",
    "message_text",
    "parse_report",
    "problem_key",
]
