"""pass@k, avg@k and maj@k: the sampled held-out numbers papers report, from `n` samples per prompt.

    >>> pass_at_k(n=5, c=2, k=2)             # 1 - C(3,2)/C(5,2) = 1 - 3/10
    0.7
    >>> majority_correct(["12", "13", "12"], [True, False, True], k=3)
    True

- **pass@k** is the chance that at least one of `k` samples is correct, estimated without bias from `n >= k`
  samples of which `c` are correct: `1 - C(n-c, k) / C(n, k)` (Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code"), averaged over prompts. It is computed as a product, never with the binomials
  themselves, so it stays exact for large `n`.
- **avg@n** is the mean correctness over all `n` samples of all prompts (pass@1 estimated from `n` samples;
  `avg_reward@n` is the same mean of the total reward).
- **maj@k** is majority voting: the most common final answer among the first `k` samples of a prompt is
  correct. Answers are compared after extraction (`answer_extractor`); a sample whose extraction finds no
  answer does not vote, and a prompt where none votes counts as wrong. A tie goes to the answer seen first.
  Whether the voted answer is correct is the verdict on the first sample that gave it (the verifier's, the
  environment's `solved`, or a total reward of 1.0).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.envs.metrics import episode_info
from tokenmill.types import ConfigError, Group, Sample

Extractor = Callable[[str], "str | None"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from `n` samples with `c` correct: `1 - C(n-c, k) / C(n, k)`, computed as
    `1 - prod_{i=n-c+1}^{n} (1 - k/i)`. Raises ValueError when k < 1, n < k, or c is not in 0..n."""
    if k < 1:
        raise ValueError(f"pass@k: k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"pass@k: k={k} needs at least k samples per prompt, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: the correct count c={c} must be between 0 and n={n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the most common answer among the first `k` (None: no answer, no vote) is correct; ties go to
    the answer seen first, and the voted answer's verdict is that of the first sample giving it."""
    if k < 1 or k > len(answers):
        raise ValueError(f"maj@k: k={k} needs 1 <= k <= the {len(answers)} samples given")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == top)
    return bool(correct[list(answers).index(winner)])


# ------------------------------------------------------------------------------------------- answers
def strip_answer(text: str) -> str | None:
    """The completion itself, surrounding whitespace removed (None when empty)."""
    return text.strip() or None


def boxed_answer(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (nested braces kept), stripped; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip() or None
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators dropped ("1,234.5" -> "1234.5"); None without one."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


ANSWER_EXTRACTORS: dict[str, Extractor] = {"strip": strip_answer, "boxed": boxed_answer, "last_number": last_number}

# a built-in task's answer extraction: what its verifier compares (addition: the stripped completion is the sum;
# countdown: the stripped expression). Tasks not named here (environments included) vote on the stripped text.
TASK_ANSWERS: dict[str, str] = {"addition": "strip", "countdown": "strip"}


def answer_extractor(spec: str | None, task: str | None = None) -> Extractor:
    """`controller.eval_answer`: a name in `ANSWER_EXTRACTORS`, or an import string of `fn(text) -> str | None`;
    unset: the task's own extraction (`TASK_ANSWERS`), else `strip`."""
    if spec is None:
        spec = TASK_ANSWERS.get(task or "", "strip")
    if spec in ANSWER_EXTRACTORS:
        return ANSWER_EXTRACTORS[spec]
    from tokenmill.config.imports import resolve

    fn = resolve(spec, "controller.eval_answer")
    if not callable(fn):
        raise ConfigError(f"controller.eval_answer: {spec!r} is not a function (want fn(text) -> str | None)")
    return fn


def final_text(sample: Sample) -> str:
    """What a sample answered: an agent-loop episode's last assistant message, else the completion (a dataset's
    own `messages` column is not an answer)."""
    messages = sample.row.get("messages") if episode_info(sample) is not None else None
    if messages:
        said = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
        if said:
            return said[-1]
    return sample.completion


# ------------------------------------------------------------------------------------------- metrics
def at_k_metrics(
    groups: list[Group], ks: Sequence[int], success: Callable[[Sample], bool], extract: Extractor,
) -> dict[str, Any]:
    """`eval/pass@k` and `eval/maj@k` for each k, `eval/avg@n` and `eval/avg_reward@n`, over groups of `n`
    samples each (one group per prompt)."""
    if not groups:
        return {}
    n = len(groups[0].samples)
    if any(len(g.samples) != n for g in groups):
        raise ValueError("at_k_metrics: every prompt needs the same number of samples")
    verdicts = [[success(s) for s in g.samples] for g in groups]
    answers = [[_extract(extract, s) for s in g.samples] for g in groups]
    out: dict[str, Any] = {}
    for k in ks:
        out[f"eval/pass@{k}"] = statistics.fmean(pass_at_k(n, sum(v), k) for v in verdicts)
    out[f"eval/avg@{n}"] = statistics.fmean(sum(v) / n for v in verdicts)
    rewards = [s.reward for g in groups for s in g.samples if not math.isnan(s.reward)]
    out[f"eval/avg_reward@{n}"] = statistics.fmean(rewards) if rewards else math.nan
    for k in ks:
        out[f"eval/maj@{k}"] = statistics.fmean(majority_correct(a, v, k) for a, v in zip(answers, verdicts))
    out["eval/samples_per_prompt"] = n
    return out


def _extract(extract: Extractor, sample: Sample) -> str | None:
    answer = extract(final_text(sample))
    return None if answer is None else str(answer)
