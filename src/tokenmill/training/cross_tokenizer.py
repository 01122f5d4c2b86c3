"""Distillation from a teacher with another tokenizer: each student token's target is its aligned text span's.

The student's completion is decoded to text, each of its tokens getting the character span it decodes to;
the teacher re-tokenises that text (its prompt rendered by its own chat template, or tokenised as plain text)
and its tokens get their spans the same way. The two segmentations of the same text are then cut at the
character offsets where both have a token boundary: the smallest common spans, each holding one or more
student tokens and one or more teacher tokens (`98` against `9`, `8`; `1`, `3`, `5` against `13`, `5`). A span's
logprob on either side is the sum of its tokens' logprobs: the probability of that piece of text given
everything before it. Each span's log ratio `r = log p_student(span) - log p_teacher(span)` is the one-sample
estimate of the reverse KL of that piece of text, and every student token in the span is given the advantage
`-kl_coef * r`: the policy gradient of the span's own estimate, since `grad log p_student(span)` is the sum
over its tokens. With identical tokenizers every span is one token and this is exactly the same-tokenizer
sampled estimate.

Tokens with no text (special tokens such as a chat end-of-turn marker) do not align and get no signal; they
are counted in `distill/unaligned_tokens`. The one exception is the end: a student completion that ends with
its eos token is scored against the teacher's eos appended to the teacher's text, so stopping is taught too.
The full reverse KL (a sum over one vocabulary at each position) has no meaning across two vocabularies, so
only the sampled estimate is offered (`distillation.loss: full` is refused with `teacher_tokenizer`). The
teacher's logprob of a span is that of its own canonical tokenisation of the text, not a sum over every
tokenisation that spells it, as in the other span-alignment methods (ULD, GOLD).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.algorithms.distill import distill_advantages
from tokenmill.training.teacher import Teacher, _padded, _scorer, _with_token_advantages
from tokenmill.types import ConfigError, Group, Sample

Span = tuple[int, int] | None  # [start, end) characters of the decoded text; None: a token with no text
WINDOW = 8  # tokens decoded before each one to find its text (a multi-byte character needs a few)


def token_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[Span]]:
    """The text `ids` decode to (special tokens skipped) and each token's character span in it.

    A token's text is what decoding it after its `WINDOW` predecessors adds to decoding them alone (a
    byte-level token that holds only part of a character adds nothing, and the token that completes it
    takes the character: zero-width spans `(s, s)`). Special tokens get None. Where the pieces do not add
    up to the whole decoded text (a decoder that rewrites across tokens), each prefix is decoded in full."""
    special = set(tokenizer.all_special_ids)
    kept = [i for i, t in enumerate(ids) if t not in special]
    plain = [ids[i] for i in kept]
    text = tokenizer.decode(plain, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    ends = _ends(tokenizer, plain, WINDOW)
    if ends is None or (ends and ends[-1] != len(text)):
        ends = _ends(tokenizer, plain, None)
    spans: list[Span] = [None] * len(ids)
    if ends is None or (ends and ends[-1] != len(text)):
        return text, spans  # pieces that never add up to the text: nothing aligns
    start = 0
    for i, end in zip(kept, ends, strict=True):
        spans[i] = (start, end)
        start = end
    return text, spans


def _ends(tokenizer: Any, ids: list[int], window: int | None) -> list[int] | None:
    """Each token's end offset in the decoded text (None where a window's pieces are not prefixes)."""
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    ends, total = [], 0
    for i in range(len(ids)):
        lo = 0 if window is None else max(0, i - window)
        # a trailing U+FFFD is part of a multi-byte character: the token that completes it takes the character
        before, after = decode(ids[lo:i]).rstrip("\ufffd"), decode(ids[lo : i + 1]).rstrip("\ufffd")
        if not after.startswith(before):
            return None
        total = len(after) if window is None else total + len(after) - len(before)
        ends.append(total)
    return ends


def align_spans(student: Sequence[Span], teacher: Sequence[Span]) -> list[tuple[list[int], list[int]]]:
    """The smallest common spans of two segmentations of the same text: for each, the indices of the student
    tokens and of the teacher tokens in it. Cuts are the offsets where both sides end a token; a token belongs
    to the span holding its first character (a zero-width token: the next character's). Tokens with no
    span (None), or zero-width at the very end, are in no span."""
    cuts = sorted({s[1] for s in student if s} & {t[1] for t in teacher if t} - {0})
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in cuts]
    for side, spans in enumerate((student, teacher)):
        for i, span in enumerate(spans):
            if span is None:
                continue
            g = _span_of(cuts, span[0])
            if g is not None:
                out[g][side].append(i)
    return [(s, t) for s, t in out if s and t]


def _span_of(cuts: list[int], offset: int) -> int | None:
    lo, hi = 0, len(cuts)
    while lo < hi:  # the first cut above `offset`: that span holds the character at `offset`
        mid = (lo + hi) // 2
        if cuts[mid] > offset:
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < len(cuts) else None


@dataclass(frozen=True)
class SpanPlan:
    """One sample's alignment: the teacher's token ids (prompt + completion, eos appended when the student's
    completion ended with its eos), where the teacher's completion starts, and the aligned spans as (student
    token positions in the whole sample, teacher token positions in `teacher_ids`)."""

    teacher_ids: tuple[int, ...]
    teacher_prompt_len: int
    spans: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def plan_sample(sample: Sample, student_tok: Any, teacher_tok: Any) -> SpanPlan:
    """Align one single-turn sample's completion with the teacher's tokens of the same text."""
    from tokenmill.rollout.generator import encode_prompt

    completion = list(sample.completion_ids)
    ends_with_eos = bool(completion) and completion[-1] == student_tok.eos_token_id
    body = completion[:-1] if ends_with_eos else completion
    text, student_spans = token_spans(student_tok, body)
    prompt = encode_prompt(teacher_tok, sample.prompt)
    # text that spells a special token (`<|end|>` written character by character) stays text for the teacher
    reply = list(teacher_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    teacher_text, teacher_spans = token_spans(teacher_tok, reply)
    spans = align_spans(student_spans, teacher_spans) if teacher_text == text else []
    p, n = sample.prompt_len, len(prompt)
    out = [(tuple(p + i for i in s), tuple(n + j for j in t)) for s, t in spans]
    if ends_with_eos and teacher_tok.eos_token_id is not None:
        out.append(((p + len(body),), (n + len(reply),)))
        reply.append(teacher_tok.eos_token_id)
    return SpanPlan(tuple(prompt + reply), n, tuple(out))


class CrossTokenizerTeacher(Teacher):
    """One teacher with its own tokenizer (`distillation.teacher_tokenizer`), behind the `Teacher` surface;
    `span_targets` gives the per-token targets of aligned spans that `distill_groups` trains with."""

    def __init__(self, scorer: Any, student_tokenizer: Any, teacher_tokenizer: Any) -> None:
        super().__init__({"teacher": scorer})
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer

    def span_targets(self, samples: Sequence[Sample], width: int):
        """`[B, T]` student and teacher logprobs in which every token of a span carries its span's sums, the
        mask of the trained tokens that aligned, each such token's share of its span (1 / its size: a span
        counts once in means), and the alignment's metrics."""
        plans = [plan_sample(s, self.student_tokenizer, self.teacher_tokenizer) for s in samples]
        (scorer,) = self.scorers.values()
        scored = scorer.score([list(p.teacher_ids) for p in plans], 0)
        student_B_T = torch.zeros(len(samples), width, dtype=torch.float64)
        teacher_B_T = torch.zeros_like(student_B_T)
        aligned_B_T = torch.zeros_like(student_B_T)
        share_B_T = torch.zeros_like(student_B_T)
        n_spans = 0
        for b, (sample, plan, score) in enumerate(zip(samples, plans, scored, strict=True)):
            teacher_lp = (0.0, *score.token_logprobs)
            for s_idx, t_idx in plan.spans:
                student_B_T[b, list(s_idx)] = sum(sample.logprobs[i] for i in s_idx)
                teacher_B_T[b, list(s_idx)] = sum(teacher_lp[j] for j in t_idx)
                aligned_B_T[b, list(s_idx)] = 1.0
                share_B_T[b, list(s_idx)] = 1.0 / len(s_idx)
            n_spans += len(plan.spans)
        mask_B_T = _padded([s.loss_mask for s in samples], width)
        trained = float(mask_B_T.sum())
        kept_B_T = mask_B_T * aligned_B_T
        return student_B_T, teacher_B_T, kept_B_T, share_B_T * mask_B_T, {
            "distill/unaligned_tokens": trained - float(kept_B_T.sum()),
            "distill/tokens_per_span": float(kept_B_T.sum()) / max(1, n_spans),
        }


def cross_distill(groups: list[Group], samples: list[Sample], teacher: CrossTokenizerTeacher, dist: Any,
                  width: int) -> tuple[list[Group], list[Sample], dict[str, float]]:
    """`distill_groups` for a teacher with another tokenizer: each trained token's advantage is its span's
    `-kl_coef * (log p_student(span) - log p_teacher(span))` (plus the task share); unaligned tokens get the
    task share only. `distill/reverse_kl` is the mean log ratio per span (per token with one tokenizer)."""
    student_B_T, teacher_B_T, mask_B_T, per_span, metrics = teacher.span_targets(samples, width)
    task_B = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    adv_B_T = distill_advantages(student_B_T, teacher_B_T, mask_B_T, kl_coef=dist.kl_coef)
    if dist.task_weight > 0:
        adv_B_T = adv_B_T + dist.task_weight * task_B[:, None] * _padded([s.loss_mask for s in samples], width)
    spans = float(per_span.sum()) or 1.0
    return _with_token_advantages(groups, samples, adv_B_T, {
        "distill/reverse_kl": float(((student_B_T - teacher_B_T) * per_span).sum()) / spans,
        "distill/teacher_logprob": float((teacher_B_T * per_span).sum()) / spans,
        "distill/student_logprob": float((student_B_T * per_span).sum()) / spans,
        **metrics,
    })


def resolve_teacher_tokenizer(dist: Any, student_tokenizer: Any) -> Any | None:
    """The teacher's tokenizer when it differs from the student's (`distillation.teacher_tokenizer`), else None:
    `same` never loads one; `auto` reads the teacher's folder and compares token-to-id maps; a path is read."""
    choice, tc = dist.teacher_tokenizer, dist.teacher
    if choice == "same":
        return None
    from transformers import AutoTokenizer

    source = tc.path if choice == "auto" else choice
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"distillation.teacher_tokenizer: cannot load a tokenizer from {source!r}: {exc}") from None
    if choice == "auto" and tok.get_vocab() == student_tokenizer.get_vocab():
        return None
    return tok


def cross_teacher(dist: Any, student_tokenizer: Any, device: torch.device, *,
                  autocast_dtype: torch.dtype | None = None) -> CrossTokenizerTeacher | None:
    """The run's teacher when its tokenizer differs from the policy's (None where `auto` finds them the same):
    the teacher in this process or behind its server, scored on its own token ids."""
    teacher_tok = resolve_teacher_tokenizer(dist, student_tokenizer)
    if teacher_tok is None:
        return None
    scorer = _scorer(dist.teacher, "distillation.teacher", None, teacher_tok, device, autocast_dtype)
    model = getattr(scorer, "model", None)
    if model is not None and len(teacher_tok) > model.config.vocab_size:
        raise ConfigError(f"distillation.teacher_tokenizer: the tokenizer has {len(teacher_tok)} tokens, the "
                          f"teacher model's vocabulary {model.config.vocab_size}: not the teacher's tokenizer")
    return CrossTokenizerTeacher(scorer, student_tokenizer, teacher_tok)
