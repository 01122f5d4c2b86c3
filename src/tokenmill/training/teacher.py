"""The teacher of on-policy distillation, and the advantage step that asks it about the student's tokens.

A teacher is anything with the engines' `Scorer` method (`score(sequences, top_k) -> [PromptLogprobs]`):
an HF causal LM in this process (an `HFEngine` over it: a teacher-forced forward) or an OpenAI-compatible
server that returns prompt logprobs (`RemoteEngine`: `tokenmill serve`, vLLM). `Teacher` puts one or several of
them behind one call: several are routed per row by a data column, or mixed (mean probability).
`distill_groups` turns their scores into per-token advantages (`algorithms.distill`). With the full reverse
KL (`distillation.loss: full`) the teacher is not asked here: the trainer runs it on each micro-batch and adds
the exact per-position KL to the loss (`LocalBackend`'s `distill_teacher`), and the advantages carry only the task
reward's share.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.algorithms.advantages import assign_advantages
from tokenmill.algorithms.distill import bucketed_logprobs, distill_advantages, mixture_logprobs
from tokenmill.config.distill import DistillConfig, TeacherConfig
from tokenmill.engines.local.vision import is_vision_config, text_config
from tokenmill.training.self_teacher import SelfTeacher, check_template
from tokenmill.training.vision_roles import check_image_distillation, load_teacher_model, scored_tokens
from tokenmill.types import ConfigError, Group, PromptLogprobs, Sample


class Teacher:
    """One or several scorers behind one call. `route_by`: each sample goes to the scorer its row's column
    names; else, with several scorers, every token gets the mixture's logprob (log of the mean probability)."""

    def __init__(self, scorers: dict[str, Any], *, route_by: str | None = None, top_k: int = 0,
                 route: Any = None) -> None:
        self.scorers = scorers
        self.route_by = route_by
        self.top_k = top_k
        # the rule from a row's column value to a teacher name (`DistillConfig.teacher_for`); default: the value
        self.route = route if route is not None else (lambda value: value if value in scorers else None)

    def score(self, samples: Sequence[Sample]) -> list[PromptLogprobs]:
        """Each sample's tokens scored (`PromptLogprobs`: len(tokens) - 1 values, from the second token)."""
        seqs = [scored_tokens(s) for s in samples]  # with their images where the prompt has any
        if self.route_by is not None:
            out: list[PromptLogprobs | None] = [None] * len(samples)
            for name, idx in self._routes(samples).items():
                for i, scored in zip(idx, self.scorers[name].score([seqs[i] for i in idx], self.top_k), strict=True):
                    out[i] = scored
            return out  # type: ignore[return-value]
        if len(self.scorers) == 1:
            return next(iter(self.scorers.values())).score(seqs, self.top_k)
        each = [scorer.score(seqs, 0) for scorer in self.scorers.values()]
        mixed = []
        for per_teacher in zip(*each, strict=True):
            lp_N_T = torch.tensor([p.token_logprobs for p in per_teacher], dtype=torch.float64)
            mixed.append(PromptLogprobs(tuple(mixture_logprobs(lp_N_T).tolist())))
        return mixed

    def _routes(self, samples: Sequence[Sample]) -> dict[str, list[int]]:
        routes: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            row = s.row or {}
            if self.route_by not in row:
                raise ConfigError(f"distillation.route_by: the row has no column {self.route_by!r} "
                                  f"(its columns: {', '.join(row) or 'none'})")
            value = row[self.route_by]
            name = self.route(value)
            if name not in self.scorers:
                raise ConfigError(f"distillation.route_by: row column {self.route_by!r} is {value!r}, which names no "
                                  f"teacher (teachers: {', '.join(self.scorers)}); map it in distillation.routes "
                                  "or set distillation.route_default")
            routes.setdefault(name, []).append(i)
        return routes

    def routed(self, samples: Sequence[Sample]) -> list[str]:
        """The name of the teacher that scores each sample (every one's with a single teacher or a mixture)."""
        if self.route_by is None:
            return ["+".join(self.scorers)] * len(samples)
        names = [""] * len(samples)
        for name, idx in self._routes(samples).items():
            for i in idx:
                names[i] = name
        return names

    @property
    def module(self) -> torch.nn.Module:
        """The one in-process teacher's module (what the full reverse KL needs)."""
        (scorer,) = self.scorers.values()
        return scorer.model

    def close(self) -> None:
        for scorer in self.scorers.values():
            scorer.close()


class TopKTeacher:
    """The trainer's view of a top-k teacher under the full loss (`distillation.loss: full` with `top_k`):
    `top` asks the scorer (a server, or an in-process engine) for its k most likely tokens at every position
    of a micro-batch's rows, for the bucketed KL (`algorithms.distill.bucketed_reverse_kl`)."""

    def __init__(self, scorer: Any, k: int) -> None:
        self.scorer, self.k = scorer, k

    def top(self, input_ids_B_T: torch.Tensor, lengths_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k ids `[B, T, K]` (-1 at pads) and logprobs (-inf at pads), index t: the distribution that
        predicts token t (nothing at t = 0)."""
        rows = [ids[:n] for ids, n in zip(input_ids_B_T.tolist(), lengths_B.tolist(), strict=True)]
        ids, lps = _top_tensors(self.scorer.score(rows, self.k), rows, input_ids_B_T.shape[1], self.k)
        return ids, lps.float()


def _padded(rows: Sequence[Sequence[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    return torch.tensor([[*r, *([fill] * (width - len(r)))] for r in rows], dtype=torch.float64)


def _top_tensors(scored: Sequence[PromptLogprobs], samples: Sequence[Sample], width: int, k: int):
    """The teacher's top-k ids and logprobs as `[B, T, K]` tensors aligned with the tokens (pads: -1, -inf)."""
    ids = torch.full((len(samples), width, k), -1, dtype=torch.long)
    lps = torch.full((len(samples), width, k), -math.inf, dtype=torch.float64)
    for b, p in enumerate(scored):
        for t, top in enumerate(p.top_logprobs or ()):
            for j, (tok, lp) in enumerate(list(top.items())[:k]):
                ids[b, t + 1, j], lps[b, t + 1, j] = int(tok), float(lp)
    return ids, lps


@torch.no_grad()
def _student_at(model: torch.nn.Module, ids_B_T: torch.Tensor, top_ids_B_T_K: torch.Tensor, temperature: float,
                rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's logprobs of the sampled tokens `[B, T]` and of the teacher's top-k ids `[B, T, K]`."""
    was_training, device = model.training, next(model.parameters()).device
    sampled, top = [], []
    model.eval()
    try:
        for start in range(0, ids_B_T.shape[0], rows):  # bounded [rows, T, V] logits at a time
            ids = ids_B_T[start : start + rows]
            logits = model(input_ids=ids.to(device), use_cache=False).logits[:, :-1].double() / temperature
            logp = torch.nn.functional.pad(torch.log_softmax(logits, -1).cpu(), (0, 0, 1, 0))
            sampled.append(logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
            top.append(logp.gather(-1, top_ids_B_T_K[start : start + rows].clamp(min=0)))
    finally:
        model.train(was_training)
    return torch.cat(sampled), torch.cat(top).masked_fill(top_ids_B_T_K < 0, -math.inf)


def distill_groups(
    groups: list[Group], teacher: Teacher, dist: DistillConfig, *, scale_rewards: bool = True,
    student: torch.nn.Module | None = None, temperature: float = 1.0, pad_id: int = 0, full: bool = False,
) -> tuple[list[Group], list[Sample], dict[str, float]]:
    """The groups with per-token distillation advantages on their trainable samples (`token_advantages`, which
    the policy loss multiplies token by token), those samples, and the step's `distill/` metrics.

    `student` (the policy module) is needed only with `dist.top_k`: its probabilities of the teacher's top-k
    tokens give the student's side of the "other" bucket. `full`: the loss carries the reverse KL (the
    trainer computes it), so the teacher is not asked and each token's advantage is the task reward's share."""
    if dist.task_weight > 0:
        groups = assign_advantages(groups, "grpo", scale_rewards=scale_rewards)
    samples = [s for g in groups for s in g.samples if s.trainable]
    if not samples:
        return groups, [], {}
    width = max(len(s.tokens) for s in samples)
    if full:
        return _task_only(groups, samples, dist, width)
    if hasattr(teacher, "span_targets"):  # another tokenizer: targets by aligned text spans
        from tokenmill.training.cross_tokenizer import cross_distill

        return cross_distill(groups, samples, teacher, dist, width)
    scored = teacher.score(samples)
    teacher_B_T = _padded([(0.0, *p.token_logprobs) for p in scored], width)
    student_B_T = _padded([s.logprobs for s in samples], width)
    mask_B_T = _padded([s.loss_mask for s in samples], width)
    if dist.top_k:
        if student is None:
            raise ValueError("distill_groups: top_k needs the student module")
        ids_B_T = torch.tensor([[*s.tokens, *([pad_id] * (width - len(s.tokens)))] for s in samples])
        top_ids, teacher_top = _top_tensors(scored, samples, width, dist.top_k)
        sampled, student_top = _student_at(student, ids_B_T, top_ids, temperature)
        student_B_T, teacher_B_T = bucketed_logprobs(ids_B_T, top_ids, teacher_top, student_top, sampled)
    task_B = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    adv_B_T = distill_advantages(student_B_T, teacher_B_T, mask_B_T, kl_coef=dist.kl_coef,
                                 task_advantages_B=task_B, task_weight=dist.task_weight)
    tokens = float(mask_B_T.sum()) or 1.0
    ratio_B_T = (student_B_T - teacher_B_T) * mask_B_T
    metrics = {
        "distill/reverse_kl": float(ratio_B_T.sum()) / tokens,
        "distill/teacher_logprob": float((teacher_B_T * mask_B_T).sum()) / tokens,
        "distill/student_logprob": float((student_B_T * mask_B_T).sum()) / tokens,
    }
    if teacher.route_by is not None:  # each teacher's own share: distill/reverse_kl/<name>
        names = teacher.routed(samples)
        for name in dict.fromkeys(names):
            rows = torch.tensor([n == name for n in names])
            metrics[f"distill/reverse_kl/{name}"] = float(ratio_B_T[rows].sum()) / (float(mask_B_T[rows].sum()) or 1.0)
    return _with_token_advantages(groups, samples, adv_B_T, metrics)


def _task_only(groups: list[Group], samples: list[Sample], dist: DistillConfig, width: int):
    """`distill_groups` under the full reverse KL: each token's advantage is `task_weight` x its group's."""
    mask_B_T = _padded([s.loss_mask for s in samples], width)
    task_B = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return _with_token_advantages(groups, samples, dist.task_weight * task_B[:, None] * mask_B_T, {})


def _with_token_advantages(groups: list[Group], samples: list[Sample], adv_B_T: torch.Tensor,
                           metrics: dict[str, float]) -> tuple[list[Group], list[Sample], dict[str, float]]:
    out = []
    for b, s in enumerate(samples):
        n, zeros = len(s.tokens), (0.0,) * len(s.tokens)
        adv = tuple(adv_B_T[b, :n].tolist())
        # returns / values: the critic's fields, unused here (the batch carries per-token rows for all three)
        out.append(s.with_(token_advantages=adv, returns=zeros, values=zeros,
                           advantage=sum(adv) / max(1, sum(s.loss_mask))))
    done = iter(out)
    groups = [Group(g.group_id, tuple(next(done) if s.trainable else s for s in g.samples)) for g in groups]
    return groups, out, metrics


def check_teacher_data(dist: DistillConfig | None, rows: Any) -> None:
    """The data checks of a distillation section (`check_routes`, the self-teacher's template columns)."""
    if dist is not None and dist.self_teacher is not None:
        check_template(dist.self_teacher, rows)
    check_routes(dist, rows)


def check_routes(dist: DistillConfig | None, rows: Any) -> None:
    """Before anything loads: every training row must reach a teacher through `route_by` (its column present,
    its value naming a teacher through `routes`, itself or `route_default`); ConfigError naming the field."""
    if dist is None or dist.route_by is None or rows is None or not hasattr(rows, "column_names"):
        return
    if dist.route_by not in rows.column_names:
        if dist.route_default is not None:
            return
        raise ConfigError(f"distillation.route_by: the data has no column {dist.route_by!r} (its columns: "
                          f"{', '.join(rows.column_names)})")
    lost = sorted({repr(v) for v in rows[dist.route_by] if dist.teacher_for(v) is None})
    if lost:
        raise ConfigError(f"distillation.route_by: rows whose {dist.route_by!r} is {', '.join(lost[:5])} name no "
                          f"teacher (teachers: {', '.join(dist.teachers)}); map them in distillation.routes or "
                          "set distillation.route_default")


def build_teacher(dist: DistillConfig | None, student: torch.nn.Module, tokenizer: Any, device: torch.device,
                  *, autocast_dtype: torch.dtype | None = None) -> Any:
    """The run's teacher (None without a distillation section); an in-process teacher must share the policy's
    vocabulary (checked here: ConfigError naming the field). A `self_teacher` is the policy itself
    (`training.self_teacher.SelfTeacher`)."""
    if dist is None:
        return None
    check_image_distillation(dist, student)
    if dist.self_teacher is not None:
        return SelfTeacher.build(dist.self_teacher, student, tokenizer, autocast_dtype=autocast_dtype)
    if dist.teacher_tokenizer != "same":  # a teacher with another tokenizer, when it has one
        from tokenmill.training.cross_tokenizer import cross_teacher

        cross = cross_teacher(dist, tokenizer, device, autocast_dtype=autocast_dtype)
        if cross is not None:
            return cross
    single = dist.teacher is not None
    scorers = {}
    for name, tc in dist.named.items():
        field = "distillation.teacher" if single else f"distillation.teachers.{name}"
        scorers[name] = _scorer(tc, field, student, tokenizer, device, autocast_dtype)
    return Teacher(scorers, route_by=dist.route_by, top_k=dist.top_k, route=dist.teacher_for)


def loss_teacher(teacher: Teacher, dist: DistillConfig) -> Any:
    """What a `LocalBackend`'s loss takes the full reverse KL to (`distillation.loss: full`, one teacher):
    the teacher's module, or with `top_k` its scorer's top-k view (`TopKTeacher`)."""
    (scorer,) = teacher.scorers.values()
    return TopKTeacher(scorer, dist.top_k) if dist.top_k else teacher.module


def _scorer(tc: TeacherConfig, field: str, student, tokenizer, device, amp):
    if tc.url is not None:
        from tokenmill.engines.remote.client import RemoteEngine

        if is_vision_config(student.config):
            raise ConfigError(f"{field}.url: a teacher server is not sent the prompts' images; a vision-language "
                              f"policy's teacher is a vision-language model in this process ({field}.path)")

        token = tc.token if tc.token is not None else os.environ.get("TOKENMILL_SERVE_TOKEN") or None
        return RemoteEngine([tc.url], pad_id=tokenizer.pad_token_id or 0, token=token, model=tc.model)
    model = load_teacher_model(tc.path, f"{field}.path", student)  # a vision-language one for a VLM policy
    if student is not None:  # None: the teacher has its own tokenizer (`tokenizer`; training.cross_tokenizer)
        _same_vocab(field, tc, model, student, tokenizer)
    from tokenmill.engines.local.hf import HFEngine

    target = device if tc.device == "auto" else torch.device(tc.device)
    model = model.to(target).eval().requires_grad_(False)
    if is_vision_config(model.config):  # scores each sequence with its prompt's images
        from tokenmill.training.vision_roles import VisionScorer

        return VisionScorer(model, autocast_dtype=amp, pad_id=tokenizer.pad_token_id or 0)
    return HFEngine(model, tokenizer, autocast_dtype=amp)


def _same_vocab(field: str, tc: TeacherConfig, model, student, tokenizer) -> None:
    """An in-process teacher without `teacher_tokenizer` must have the policy's vocabulary (ConfigError)."""
    from transformers import AutoTokenizer

    mine, theirs = text_config(student.config).vocab_size, text_config(model.config).vocab_size
    if mine != theirs:
        raise ConfigError(f"{field}.path: the teacher's vocabulary has {theirs} tokens, the policy's {mine}; "
                          "distillation compares logprobs token by token and needs the same tokenizer "
                          "(or set distillation.teacher_tokenizer: auto to align text spans)")
    try:
        teacher_vocab = AutoTokenizer.from_pretrained(tc.path).get_vocab()
    except (OSError, ValueError):
        teacher_vocab = None  # a folder with weights only: the vocabulary size is all that can be checked
    if teacher_vocab is not None and teacher_vocab != tokenizer.get_vocab():
        raise ConfigError(f"{field}.path: the teacher's tokenizer maps tokens to other ids than the policy's; "
                          "distillation needs the same tokenizer (or set distillation.teacher_tokenizer: auto "
                          "to align text spans)")
