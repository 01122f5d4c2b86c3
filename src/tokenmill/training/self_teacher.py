"""Self-distillation (OPSD / SDFT-style): the policy, shown privileged context, is its own teacher.

The student samples from the plain prompt; the teacher is the same model (the current policy, scored before
the step's update, or a frozen copy of the starting weights) given a *privileged* prompt built from the row
by `distillation.self_teacher.template` (the reference answer, a hint column). The teacher scores the
student's completion after that prompt (teacher forcing), and its logprobs of those tokens are the target
of the sampled reverse-KL estimate (`algorithms.distill.distill_advantages`) exactly as an external
teacher's would be. No second model is loaded for `snapshot: policy`.

    distillation:
      self_teacher: {template: "The answer is {answer}. {prompt}"}

A plain-text prompt is replaced by the rendered template; in a chat prompt the last user message's content
is (its original content is `{prompt}` in the template).
"""

from __future__ import annotations

import copy
import string
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.config.distill import SelfTeacherConfig
from tokenmill.types import ConfigError, PromptLogprobs, Sample

FIELD = "distillation.self_teacher.template"


def template_columns(template: str) -> list[str]:
    """The row columns a template reads (`{answer}` -> answer)."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError as exc:
        raise ConfigError(f"{FIELD}: {exc}") from None


def privileged_prompt(template: str, row: dict[str, Any], prompt: Any) -> Any:
    """The teacher's prompt for one row: the template rendered over the row's columns (`{prompt}`: the plain
    prompt's text); for chat messages, the last user message with that text as its content."""
    last_user = None
    if isinstance(prompt, list):
        last_user = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=None)
        text = prompt[last_user]["content"] if last_user is not None else ""
    else:
        text = prompt
    try:
        rendered = template.format(**{**row, "prompt": text})
    except (KeyError, IndexError) as exc:
        raise ConfigError(f"{FIELD}: the row has no column {exc} (its columns: {', '.join(row)})") from None
    if not isinstance(prompt, list):
        return rendered
    messages = copy.deepcopy(prompt)
    if last_user is None:
        return [*messages, {"role": "user", "content": rendered}]
    messages[last_user]["content"] = rendered
    return messages


def check_template(cfg: SelfTeacherConfig | None, rows: Any) -> None:
    """Before anything loads: every column the template reads is in the data (ConfigError naming the field)."""
    if cfg is None or rows is None or not hasattr(rows, "column_names"):
        return
    missing = [c for c in template_columns(cfg.template) if c != "prompt" and c not in rows.column_names]
    if missing:
        raise ConfigError(f"{FIELD}: the data has no column {missing[0]!r} (its columns: "
                          f"{', '.join(rows.column_names)})")


class SelfTeacher:
    """The policy as its own teacher: `score(samples)` gives each sample's tokens the logprobs a teacher-forced
    forward of `scorer` (an `HFEngine` over the policy or its frozen copy) assigns them after the row's
    privileged prompt, aligned like `Teacher.score` (len(tokens) - 1 values, from the second token; the
    sample's own prompt positions get 0, which the loss mask drops)."""

    def __init__(self, scorer: Any, tokenizer: Any, template: str) -> None:
        self.scorer, self.tokenizer, self.template = scorer, tokenizer, template
        self.scorers = {"self": scorer}
        self.route_by, self.top_k = None, 0

    @classmethod
    def build(cls, cfg: SelfTeacherConfig, student: torch.nn.Module, tokenizer: Any, *,
              autocast_dtype: torch.dtype | None = None) -> SelfTeacher:
        """`snapshot: policy` scores with the trainer's own module (no copy); `initial` with a frozen copy of
        the weights it has now, at the start of the run."""
        from tokenmill.engines.local.hf import HFEngine

        model = student if cfg.snapshot == "policy" else copy.deepcopy(student).eval().requires_grad_(False)
        return cls(HFEngine(model, tokenizer, autocast_dtype=autocast_dtype), tokenizer, cfg.template)

    def teacher_sequences(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Each sample's privileged prompt tokens followed by its own completion (and environment) tokens."""
        from tokenmill.rollout.generator import encode_prompt

        out = []
        for s in samples:
            prompt = privileged_prompt(self.template, dict(s.row or {}), s.prompt)
            out.append(encode_prompt(self.tokenizer, prompt) + list(s.tokens[s.prompt_len :]))
        return out

    def score(self, samples: Sequence[Sample]) -> list[PromptLogprobs]:
        seqs = self.teacher_sequences(samples)
        scored = self.scorer.score(seqs, 0)
        out = []
        for s, seq, p in zip(samples, seqs, scored, strict=True):
            n = len(s.tokens) - s.prompt_len  # the completion's tokens: the last n of the teacher's sequence
            tail = p.token_logprobs[len(seq) - 1 - n :]
            out.append(PromptLogprobs((0.0,) * (s.prompt_len - 1) + tuple(tail)))
        return out

    def routed(self, samples: Sequence[Sample]) -> list[str]:
        return ["self"] * len(samples)

    def close(self) -> None:
        self.scorer.close()
