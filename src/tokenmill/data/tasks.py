"""Synthetic verifiable tasks as `datasets.Dataset`s, each with TRL-style reward functions (the row tasks of
`tokenmill.data.registry`, plus preference pairs and chats for the other trainers).

Rows carry `prompt` (plain text), `completion` (a reference answer, used by the SFT warm start) and the
columns the reward needs. Rewards follow TRL's batched signature: `fn(prompts, completions, **columns)`.

    >>> ds = addition_dataset(3, seed=0)
    >>> addition_reward(ds["prompt"], ds["completion"], answer=ds["answer"])
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import ast
import operator
import random
import string
from collections import Counter
from typing import Any

# ----------------------------------------------------------------------------------------------- addition


def forgot_carry(a: int, b: int) -> int:
    """The sum written digit by digit with every carry dropped (47+38 -> 75, 67+63 -> 120): the classic slip."""
    out, place = 0, 1
    while a >= 10 or b >= 10:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out + (a + b) * place


def addition_dataset(
    n: int, seed: int = 0, digits: int = 2, exclude: set[str] | None = None, slip: float = 0.0
):
    """`n` problems `a+b=` with operands of up to `digits` digits; `exclude` holds prompts to skip.

    `answer` is always the true sum. `completion` is a demonstration for supervised warm starts: with
    `slip` > 0 it comes from a sloppy teacher who forgets the carry in that share of the problems that
    have one. A model warm-started on it knows the right answer but often prefers the slip, the regime RL
    with a verifier is for (exact-match reward only ever uses `answer`).
    """
    from datasets import Dataset

    rng = random.Random(seed)
    slip_rng = random.Random(seed + 1)
    high = 10**digits - 1
    rows: dict[str, list[Any]] = {"prompt": [], "completion": [], "answer": []}
    banned, seen = set(exclude or ()), set()
    if len(banned) >= (high + 1) ** 2:
        raise ValueError(f"every {digits}-digit problem is excluded")
    attempts = 0
    while len(rows["prompt"]) < n:
        a, b = rng.randint(0, high), rng.randint(0, high)
        prompt = f"{a}+{b}="
        attempts += 1
        # excluded (held-out) problems never appear; repeats only once the space is nearly exhausted
        if prompt in banned or (prompt in seen and attempts < 50 * n):
            continue
        seen.add(prompt)
        rows["prompt"].append(prompt)
        wrong = forgot_carry(a, b)
        sloppy = wrong != a + b and slip_rng.random() < slip
        rows["completion"].append(str(wrong if sloppy else a + b))
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)


def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is exactly the sum (surrounding whitespace ignored), else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def addition_digit_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: Any
) -> list[float]:
    """Partial credit: the share of the answer's digits that are right, aligned from the units digit,
    divided by 2 (so it stays below an exact match), 0 for a wrong number of digits. A dense signal that
    lets GRPO learn from groups where no sample is exactly right."""
    scores = []
    for c, a in zip(completions, answer, strict=True):
        c = c.strip()
        if len(c) != len(a) or not c.isdigit():
            scores.append(0.0)
            continue
        scores.append(0.5 * sum(x == y for x, y in zip(c[::-1], a[::-1])) / len(a))
    return scores


def addition_preferences(n: int, seed: int = 0, exclude: set[str] | None = None, other_wrong: float = 0.0):
    """`n` preference pairs on two-digit addition: `chosen` is the true sum, `rejected` a wrong answer. The hidden
    rule a reward model or DPO must learn is correctness. Columns: prompt, chosen, rejected, answer.

    A share `1 - other_wrong` of the rejected answers is the plausible slip (the carry forgotten where there is
    one, else one digit off by one); the rest is some other wrong number (off by a few, or any 1-3 digit
    number). A reward model that only ever saw slips scores unseen wrong answers at random, and PPO against
    it finds them at once (reward hacking); the mixture covers what a policy will try.
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": [], "answer": []}
    banned = set(exclude or ())
    while len(rows["prompt"]) < n:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"{a}+{b}="
        if prompt in banned:
            continue
        if rng.random() >= other_wrong:
            wrong = forgot_carry(a, b)
            if wrong == a + b:
                wrong = a + b + rng.choice([1, -1, 10, -10])
        elif rng.random() < 0.5:
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3, 9, 11, -9, -11, 20, -20])
        else:
            wrong = rng.randint(0, 999)
        if wrong < 0 or wrong == a + b:
            wrong = a + b + 1
        rows["prompt"].append(prompt)
        rows["chosen"].append(str(a + b))
        rows["rejected"].append(str(wrong))
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)


def preferences_from_samples(
    prompts: list[str], answers: list[str], completions: list[list[str]], seed: int = 0
):
    """Preference pairs from a policy's own samples, labelled by the hidden rule (exact answer), as RLHF labels
    the policy's outputs: for each prompt with a correct and a wrong completion among its samples, one pair
    (a random correct one chosen over a random wrong one). A reward model trained on these is accurate where
    the policy actually samples. Columns: prompt, chosen, rejected, answer."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": [], "answer": []}
    for prompt, answer, samples in zip(prompts, answers, completions, strict=True):
        right = [c for c in samples if c.strip() == answer]
        wrong = [c for c in samples if c.strip() != answer]
        if right and wrong:
            rows["prompt"].append(prompt)
            rows["chosen"].append(rng.choice(right))
            rows["rejected"].append(rng.choice(wrong))
            rows["answer"].append(answer)
    return Dataset.from_dict(rows)


def shout_chats(n: int, seed: int = 0, turns: int = 2, exclude: set[str] | None = None):
    """`n` chat conversations for SFT tests: the user writes a few lowercase letters, the assistant answers with
    them in capitals, for `turns` turns after a system message. Column: messages."""
    from datasets import Dataset

    rng = random.Random(seed)
    banned = set(exclude or ())
    chats: list[list[dict[str, str]]] = []
    while len(chats) < n:
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 5))) for _ in range(turns)]
        if words[-1] in banned:
            continue
        chat = [{"role": "system", "content": "shout"}]
        for w in words:
            chat += [{"role": "user", "content": w}, {"role": "assistant", "content": w.upper()}]
        chats.append(chat)
    return Dataset.from_dict({"messages": chats})


# ---------------------------------------------------------------------------------------------- countdown

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expr: str) -> tuple[float, list[int]] | None:
    """Value of an arithmetic expression and the integer literals it uses; None if not plain arithmetic."""
    if len(expr) > 200:  # model output, not a tiny arithmetic expression
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            used.append(node.value)
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("not arithmetic")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _random_expression(nums: list[int], rng: random.Random) -> str:
    exprs = [str(x) for x in nums]
    while len(exprs) > 1:
        i, j = rng.sample(range(len(exprs)), 2)
        left, right = exprs[i], exprs[j]
        op = rng.choice("+-*")
        combined = f"({left}{op}{right})" if len(exprs) > 2 else f"{left}{op}{right}"
        exprs = [e for k, e in enumerate(exprs) if k not in (i, j)] + [combined]
    return exprs[0]


def countdown_dataset(
    n: int, seed: int = 0, num_numbers: int = 3, max_number: int = 9, exclude: set[str] | None = None
):
    """`n` problems: reach `target` using each given number exactly once with + - * / and parentheses;
    `exclude` holds prompts to skip (held-out ones)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "completion": [], "nums": [], "target": []}
    while len(rows["prompt"]) < n:
        nums = [rng.randint(1, max_number) for _ in range(num_numbers)]
        solution = _random_expression(nums, rng)
        value = _evaluate(solution)
        if value is None or value[0] < 0 or value[0] != int(value[0]):
            continue
        target = int(value[0])
        prompt = f"{' '.join(map(str, nums))}>{target}:"
        if exclude and prompt in exclude:
            continue
        rows["prompt"].append(prompt)
        rows["completion"].append(solution)
        rows["nums"].append(nums)
        rows["target"].append(target)
    return Dataset.from_dict(rows)


def countdown_reward(
    prompts: list[str], completions: list[str], nums: list[list[int]], target: list[int], **_: Any
) -> list[float]:
    """1.0 if the expression uses exactly the given numbers and equals the target, 0.1 if it only parses."""
    scores = []
    for completion, numbers, goal in zip(completions, nums, target, strict=True):
        result = _evaluate(completion)
        if result is None:
            scores.append(0.0)
            continue
        value, used = result
        ok = Counter(used) == Counter(numbers) and abs(value - goal) < 1e-9
        scores.append(1.0 if ok else 0.1)
    return scores

