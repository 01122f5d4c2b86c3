"""The distillation teacher on real tiny models: in-process scoring equals a plain forward, the per-token
advantages equal minus the log ratio, routing and mixing of several teachers, top-k bucketing end to end, and
a teacher with another vocabulary refused naming the field."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.testing import build_tiny_model
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.training.teacher import build_teacher, distill_groups
from tokenmill.types import ConfigError, Group, Sample, StopReason


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return [build_tiny_model(root / f"t{i}", hidden_size=32, num_layers=1, seed=10 + i) for i in range(2)]


@functools.cache
def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _groups(tokenizer, tasks=("a", "b")) -> list[Group]:
    """Two groups of two samples: prompt '12+3=' / '7+40=', completions with made-up sampler logprobs; the
    last sample of the second group failed its reward (not trainable)."""
    out = []
    for g, (prompt, answers, task) in enumerate(((("12+3="), ("15", "16"), tasks[0]),
                                                 (("7+40="), ("47", "4"), tasks[1]))):
        p = tokenizer.encode(prompt)
        samples = []
        for k, answer in enumerate(answers):
            c = tokenizer.encode(answer)
            samples.append(Sample(
                tokens=tuple(p + c), loss_mask=(0,) * len(p) + (1,) * len(c),
                logprobs=(0.0,) * len(p) + tuple(-0.5 - 0.25 * j - k for j in range(len(c))),
                prompt_len=len(p), prompt=prompt, completion=answer, stop_reason=StopReason.STOP,
                group_id=g, reward=float("nan") if (g, k) == (1, 1) else float(k == 0), row={"task": task},
            ))
        out.append(Group(g, tuple(samples)))
    return out


def _reference(path, s: Sample) -> list[float]:
    return teacher_logprobs(_load(path), s.tokens[: s.prompt_len], s.tokens[s.prompt_len :])


def _distill(cfg: dict, tiny_model, tokenizer, groups):
    dist = DistillConfig(**cfg)
    teacher = build_teacher(dist, tiny_model, tokenizer, torch.device("cpu"))
    return distill_groups(groups, teacher, dist, student=tiny_model, pad_id=tokenizer.pad_token_id)


def test_per_token_advantages_are_minus_the_log_ratio_to_an_in_process_teacher(teachers, tiny_model, tokenizer):
    groups, samples, metrics = _distill({"teacher": {"path": teachers[0]}, "kl_coef": 0.5}, tiny_model, tokenizer,
                                        _groups(tokenizer))
    assert len(samples) == 3 and groups[1].samples[1].token_advantages == ()  # the failed sample is left alone
    ratios = []
    for s in samples:
        teacher = _reference(teachers[0], s)
        student = s.logprobs[s.prompt_len :]
        expected = [-0.5 * (a - b) for a, b in zip(student, teacher, strict=True)]
        assert s.token_advantages[: s.prompt_len] == (0.0,) * s.prompt_len
        assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)
        assert len(s.returns) == len(s.values) == len(s.tokens)
        ratios += [a - b for a, b in zip(student, teacher, strict=True)]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-5)


def test_task_weight_adds_the_groups_grpo_advantage(teachers, tiny_model, tokenizer):
    _, plain, _ = _distill({"teacher": {"path": teachers[0]}}, tiny_model, tokenizer, _groups(tokenizer))
    _, mixed, _ = _distill({"teacher": {"path": teachers[0]}, "task_weight": 0.5}, tiny_model, tokenizer,
                           _groups(tokenizer))
    # group 0: rewards (1, 0) -> GRPO advantages +-0.5 / (std sqrt(0.5) + eps); group 1 has one valid sample -> 0
    grpo = 0.5 / (math.sqrt(0.5) + 1e-4)
    for p, m, task in zip(plain, mixed, (grpo, -grpo, 0.0), strict=True):
        shift = [b - a for a, b in zip(p.token_advantages, m.token_advantages, strict=True)]
        assert shift == pytest.approx([0.5 * task * k for k in p.loss_mask], abs=1e-6)


def test_route_by_scores_each_row_with_the_teacher_its_column_names(teachers, tiny_model, tokenizer):
    cfg = {"teachers": {"a": {"path": teachers[0]}, "b": {"path": teachers[1]}}, "route_by": "task"}
    _, samples, _ = _distill(cfg, tiny_model, tokenizer, _groups(tokenizer))
    for s in samples:
        path = teachers[0] if s.row["task"] == "a" else teachers[1]
        expected = [t - st for st, t in zip(s.logprobs[s.prompt_len :], _reference(path, s), strict=True)]
        assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ConfigError, match="distillation.route_by: row column 'task' is 'c', which names no teacher"):
        _distill(cfg, tiny_model, tokenizer, _groups(tokenizer, tasks=("a", "c")))


def test_several_teachers_without_routing_score_with_their_mixture(teachers, tiny_model, tokenizer):
    cfg = {"teachers": {"a": {"path": teachers[0]}, "b": {"path": teachers[1]}}}
    _, samples, _ = _distill(cfg, tiny_model, tokenizer, _groups(tokenizer))
    s = samples[0]
    mixture = [math.log((math.exp(a) + math.exp(b)) / 2)
               for a, b in zip(_reference(teachers[0], s), _reference(teachers[1], s), strict=True)]
    expected = [t - st for st, t in zip(s.logprobs[s.prompt_len :], mixture, strict=True)]
    assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)


def test_top_k_buckets_tokens_outside_the_teachers_top_k_as_other(teachers, tiny_model, tokenizer):
    """top_k 1 by hand from both full distributions: the teacher's argmax keeps its logprobs, any other token
    is 'other' with log(1 - p(argmax)) on each side; top_k = the vocabulary is the plain estimate."""
    _, samples, _ = _distill({"teacher": {"path": teachers[0]}, "top_k": 1}, tiny_model, tokenizer,
                             _groups(tokenizer))
    teacher = _load(teachers[0])
    for s in samples:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            lp_s = torch.log_softmax(tiny_model(ids).logits[0].double(), -1)
            lp_t = torch.log_softmax(teacher(ids).logits[0].double(), -1)
        for t in range(s.prompt_len, len(s.tokens)):
            top = int(lp_t[t - 1].argmax())
            tok = s.tokens[t]
            if tok == top:
                pair = (lp_s[t - 1, tok].item(), lp_t[t - 1, tok].item())
            else:
                pair = (math.log1p(-lp_s[t - 1, top].exp().item()), math.log1p(-lp_t[t - 1, top].exp().item()))
            assert s.token_advantages[t] == pytest.approx(pair[1] - pair[0], abs=1e-5)
    vocab = tiny_model.config.vocab_size
    _, full, _ = _distill({"teacher": {"path": teachers[0]}, "top_k": vocab}, tiny_model, tokenizer,
                          _groups(tokenizer))
    for s in full:  # the student's own forward replaces the made-up sampler logprobs here
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            lp_s = torch.log_softmax(tiny_model(ids).logits[0].double(), -1)
        student = [lp_s[t - 1, s.tokens[t]].item() for t in range(s.prompt_len, len(s.tokens))]
        expected = [b - a for a, b in zip(student, _reference(teachers[0], s), strict=True)]
        assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_field(tmp_path, tiny_model, tokenizer, teachers):
    model = _load.__wrapped__(teachers[0])
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model.save_pretrained(tmp_path / "wide")
    with pytest.raises(ConfigError, match=r"distillation.teachers.b.path: the teacher's vocabulary has \d+ tokens"):
        build_teacher(DistillConfig(teachers={"a": {"path": teachers[0]}, "b": {"path": str(tmp_path / "wide")}}),
                      tiny_model, tokenizer, torch.device("cpu"))
