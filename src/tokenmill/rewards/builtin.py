"""Rewards shipped with tokenmill, named in a config by `rewards: [{builtin: <name>, ...}]`.

`math_verify`: the completion's final answer (LaTeX, `\\boxed{...}`, or a plain number or expression) is
compared with the row's reference answer by Hugging Face's math-verify (`parse` both, then `verify`), which
knows that `\\boxed{\\frac{1}{2}}`, `0.5` and `$\\frac12$` are the same answer. 1.0 when they are, 0.0 when not
(or when the completion gives no answer it can read); a reference answer math-verify cannot parse abstains
(None), as TRL's accuracy reward does. Each sample has math-verify's own time limit (`timeout_s`, for parsing
and for verifying), so one pathological expression scores 0 in that time instead of stalling the batch.
What it read from each completion is logged per sample (`log_extra("parsed_answer", ...)`).

    >>> reward = MathVerifyReward(column="answer")                                   # doctest: +SKIP
    >>> reward(prompts=["1/2?"], completions=["\\\\boxed{\\\\frac{1}{2}}"], answer=["0.5"])  # doctest: +SKIP
    [1.0]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tokenmill.types import ConfigError

EXTRA = "pip install tokenmill[tasks]"


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ConfigError(f"rewards: the math_verify reward needs the math-verify package: {EXTRA}") from None
    return math_verify


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # a chat completion: one assistant message in a list
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


class MathVerifyReward:
    """math-verify's equivalence of each completion's answer with the row's `column` (a TRL-style reward)."""

    __name__ = "math_verify"

    def __init__(self, column: str = "answer", timeout_s: int = 5) -> None:
        _math_verify()  # a missing package is said now, not at the first step
        self.column = column
        self.timeout_s = int(timeout_s)
        # the signature names the column, so the config check can say when the dataset lacks it
        params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in ("completions", column)]
        self.__signature__ = inspect.Signature([*params, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

    def score(self, completion: str, reference: Any) -> tuple[float | None, str]:
        """(1.0 / 0.0, or None when the reference cannot be parsed; what was read from the completion)."""
        from math_verify import parse, verify

        gold = parse(str(reference), parsing_timeout=self.timeout_s)
        if not gold:
            gold = parse(f"${reference}$", parsing_timeout=self.timeout_s)  # a bare LaTeX answer: 'frac12'
        if not gold:
            return None, ""
        pred = parse(completion, parsing_timeout=self.timeout_s)
        if not pred:
            return 0.0, ""
        shown = str(pred[-1])  # parse gives [the value, the text it was read from]
        return (1.0 if verify(gold, pred, timeout_seconds=self.timeout_s) else 0.0), shown[:200]

    def __call__(self, completions: list[Any], log_extra: Callable[..., Any] | None = None, **columns: Any):
        if self.column not in columns:
            raise KeyError(f"math_verify compares with the dataset column {self.column!r}, which the rows lack "
                           f"(columns: {', '.join(sorted(columns))}); set rewards.N.column")
        scored = [self.score(_text(c), ref) for c, ref in zip(completions, columns[self.column], strict=True)]
        if log_extra is not None:
            log_extra("parsed_answer", [shown for _, shown in scored])
        return [value for value, _ in scored]


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {"math_verify": MathVerifyReward}


def builtin_reward(rc: Any) -> Callable[..., Any]:
    """The reward function of a `RewardBuiltinConfig`."""
    if rc.builtin == "math_verify":
        return MathVerifyReward(column=rc.column, timeout_s=rc.timeout_s)
    raise ConfigError(f"rewards: unknown builtin {rc.builtin!r} (built-in: {', '.join(BUILTIN_REWARDS)})")
