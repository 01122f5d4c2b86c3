"""The problems behind `coding_tasks`: 18 templates of small function-writing problems, each drawing its
constants at random, with a reference solution and hidden tests computed here on the host."""

from __future__ import annotations

import functools
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
