"""A teacher with another tokenizer: character spans of real tokenizers' tokens, the smallest common spans
against hand-listed ones, the teacher's span logprobs against a plain forward's sums, the advantages and
metrics against hand-computed values, identical tokenizers giving exactly the same-tokenizer advantages, and
`build_teacher` choosing the path by `distillation.teacher_tokenizer`."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.recipes.tiny import build_tokenizer
from tokenmill.recipes.tiny_bpe import build_bpe_tokenizer, build_tiny_bpe_model
from tokenmill.testing import build_tiny_model
from tokenmill.training.cross_tokenizer import (
    CrossTokenizerTeacher,
    align_spans,
    plan_sample,
    token_spans,
)
from tokenmill.training.teacher import Teacher, build_teacher, distill_groups
from tokenmill.types import ConfigError, Group, Sample, StopReason


@pytest.fixture(scope="module")
def toks():
    return build_tokenizer(), build_bpe_tokenizer()


@pytest.fixture(scope="module")
def bpe_teacher(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_bpe_model(tmp_path_factory.mktemp("bpe") / "t", hidden_size=32, num_layers=1, seed=3)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _sample(tok, prompt: str, completion: str, logprobs: list[float], eos: bool = True) -> Sample:
    p = list(tok(prompt)["input_ids"])
    c = list(tok(completion, add_special_tokens=False)["input_ids"]) + ([tok.eos_token_id] if eos else [])
    assert len(logprobs) == len(c)
    return Sample(tokens=tuple(p + c), loss_mask=(0,) * len(p) + (1,) * len(c),
                  logprobs=(0.0,) * len(p) + tuple(logprobs), prompt_len=len(p), prompt=prompt,
                  completion=completion, stop_reason=StopReason.STOP)


def test_character_and_bpe_spans_of_the_same_text(toks):
    """The quickstart's character tokenizer gives every digit its own span; the BPE joins `98`, `37`, `13`."""
    char, bpe = toks
    text, spans = token_spans(char, char("98+37=135")["input_ids"])
    assert text == "98+37=135" and spans == [(i, i + 1) for i in range(9)]
    ids = bpe("98+37=135", add_special_tokens=False)["input_ids"]
    assert bpe.convert_ids_to_tokens(ids) == ["98", "+", "37", "=", "13", "5"]
    assert token_spans(bpe, ids) == ("98+37=135", [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 9)])
    # a special token has no text; a byte of a two-byte character has zero width, its completion the character
    assert token_spans(char, [*char("12")["input_ids"], char.eos_token_id]) == ("12", [(0, 1), (1, 2), None])
    assert token_spans(bpe, bpe("aé", add_special_tokens=False)["input_ids"]) == ("aé", [(0, 1), (1, 1), (1, 2)])


def test_smallest_common_spans_by_hand():
    # 98+37=135: character tokens against 98 | + | 37 | = | 13 | 5
    student = [(i, i + 1) for i in range(9)]
    teacher = [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 9)]
    assert align_spans(student, teacher) == [([0, 1], [0]), ([2], [1]), ([3, 4], [2]), ([5], [3]),
                                             ([6, 7], [4]), ([8], [5])]
    # "12|3" against "1|23": no common cut inside, one span of two tokens each
    assert align_spans([(0, 2), (2, 3)], [(0, 1), (1, 3)]) == [([0, 1], [0, 1])]
    # "ab|cd|e" against "a|bcd|e"; a special token (None) and a trailing zero-width token are in no span
    assert align_spans([(0, 2), (2, 4), None, (4, 5)], [(0, 1), (1, 4), (4, 5), (5, 5)]) == [
        ([0, 1], [0, 1]), ([3], [2])]
    # a zero-width byte token joins the span of the character it starts
    assert align_spans([(0, 1), (1, 2)], [(0, 1), (1, 1), (1, 2)]) == [([0], [0]), ([1], [1, 2])]


def test_teacher_span_logprobs_are_sums_of_a_plain_forward(toks, bpe_teacher):
    """Student `1`,`3` | `5` | eos against teacher `13` | `5` | eos after the prompt `98+37=` in each's own
    tokens: each student token carries its span's teacher logprob, the sum over the teacher's tokens of a
    teacher-forced forward, and its span's summed student logprob."""
    from tokenmill.engines.local.hf import HFEngine

    char, _ = toks
    _, model, bpe = bpe_teacher
    sample = _sample(char, "98+37=", "135", [-0.5, -0.25, -1.0, -0.125])
    ids = bpe("98+37=")["input_ids"] + bpe("135", add_special_tokens=False)["input_ids"] + [bpe.eos_token_id]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    direct = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()  # direct[j - 1]: token j
    n = len(bpe("98+37=")["input_ids"])
    plan = plan_sample(sample, char, bpe)
    assert list(plan.teacher_ids) == ids and plan.teacher_prompt_len == n
    assert plan.spans == ((tuple(range(6, 8)), (n,)), ((8,), (n + 1,)), ((9,), (n + 2,)))
    teacher = CrossTokenizerTeacher(HFEngine(model, bpe), char, bpe)
    student_B_T, teacher_B_T, mask_B_T, share_B_T, metrics = teacher.span_targets([sample], 10)
    want_teacher = [direct[n - 1]] * 2 + [direct[n], direct[n + 1]]
    torch.testing.assert_close(teacher_B_T[0, 6:], torch.tensor(want_teacher, dtype=torch.float64), atol=1e-5, rtol=0)
    assert student_B_T[0, 6:].tolist() == [-0.75, -0.75, -1.0, -0.125]
    assert mask_B_T[0].tolist() == [0.0] * 6 + [1.0] * 4 and share_B_T[0, 6:].tolist() == [0.5, 0.5, 1.0, 1.0]
    assert metrics == {"distill/unaligned_tokens": 0.0, "distill/tokens_per_span": 4 / 3}


def test_text_spelling_a_special_token_stays_text(toks):
    """A student that writes `<|end|>` character by character wrote text: the teacher reads it as text too
    (its bytes), not as its end-of-turn token, so every character aligns."""
    char, bpe = toks
    spelled = [char.convert_tokens_to_ids(c) for c in "1<|end|>"]
    sample = Sample(tokens=(5, *spelled), loss_mask=(0,) + (1,) * 8, logprobs=(0.0,) * 9, prompt_len=1,
                    prompt="1+0=", completion="1<|end|>", stop_reason=StopReason.LENGTH)
    plan = plan_sample(sample, char, bpe)
    assert sorted(i for s, _ in plan.spans for i in s) == list(range(1, 9))
    assert bpe.eos_token_id not in plan.teacher_ids[plan.teacher_prompt_len:]


class _Fixed:  # a scripted teacher model (the loss by hand needs round numbers)
    """A scorer whose teacher says the same logprob of every token it is asked about (a hand-made teacher)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, sequences, top_k=0):
        from tokenmill.types import PromptLogprobs

        return [PromptLogprobs((self.value,) * (len(s) - 1)) for s in sequences]

    def close(self) -> None:
        pass


def test_advantages_and_metrics_by_hand(toks):
    """Teacher logprob -0.5 for every one of its tokens. `135` + eos: spans `13` (student -0.5 - 0.25 = -0.75,
    teacher -0.5: r = -0.25), `5` (-1.0 vs -0.5: r = -0.5), eos (-0.125 vs -0.5: r = 0.375); with kl_coef 2
    the advantages are -2 r per token of each span, the reverse KL the mean over the 3 spans."""
    char, bpe = toks
    sample = _sample(char, "98+37=", "135", [-0.5, -0.25, -1.0, -0.125])
    dist = DistillConfig(teacher={"path": "t"}, kl_coef=2.0, teacher_tokenizer="auto")
    _, out, metrics = distill_groups([Group(0, (sample,))], CrossTokenizerTeacher(_Fixed(-0.5), char, bpe), dist)
    assert out[0].token_advantages[6:] == (0.5, 0.5, 1.0, -0.75)
    assert out[0].token_advantages[:6] == (0.0,) * 6
    assert metrics["distill/reverse_kl"] == pytest.approx((-0.25 - 0.5 + 0.375) / 3)
    assert metrics["distill/teacher_logprob"] == pytest.approx(-0.5)
    assert metrics["distill/student_logprob"] == pytest.approx((-0.75 - 1.0 - 0.125) / 3)
    assert metrics["distill/unaligned_tokens"] == 0.0
    # a special token in the middle of the completion has no text: masked (advantage 0) and counted
    mid = sample.with_(tokens=(*sample.tokens[:7], char.convert_tokens_to_ids("<|tool|>"), *sample.tokens[7:]),
                       loss_mask=(*sample.loss_mask, 1), logprobs=(*sample.logprobs[:7], -3.0, *sample.logprobs[7:]))
    _, out, metrics = distill_groups([Group(0, (mid,))], CrossTokenizerTeacher(_Fixed(-0.5), char, bpe), dist)
    assert out[0].token_advantages[6:] == (0.5, 0.0, 0.5, 1.0, -0.75) and metrics["distill/unaligned_tokens"] == 1.0


def test_identical_tokenizers_give_exactly_the_same_tokenizer_advantages(tmp_path, toks):
    """The policy's own tokenizer on both sides: every span is one token, and the cross-tokenizer path's
    advantages and metrics are bit for bit the same-tokenizer path's (one teacher forward of the same ids)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.engines.local.hf import HFEngine

    char, _ = toks
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "t", hidden_size=32, num_layers=1,
                                                                  seed=5), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    samples = []
    for prompt, completion, eos in [("98+37=", "135", True), ("7+5=", "12", True), ("50+50=", "10", False)]:
        n = len(completion) + eos
        samples.append(_sample(char, prompt, completion, (-torch.rand(n, generator=gen, dtype=torch.float64)).tolist(),
                               eos=eos))
    groups = [Group(0, tuple(samples[:2])), Group(1, tuple(samples[2:]))]
    dist = DistillConfig(teacher={"path": "t"}, kl_coef=1.5)
    _, same, same_metrics = distill_groups(groups, Teacher({"teacher": HFEngine(model, char)}), dist)
    _, cross, cross_metrics = distill_groups(groups, CrossTokenizerTeacher(HFEngine(model, char), char, char), dist)
    assert [s.token_advantages for s in cross] == [s.token_advantages for s in same]
    assert any(a != 0.0 for s in same for a in s.token_advantages)
    for key, value in same_metrics.items():
        assert cross_metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert cross_metrics["distill/tokens_per_span"] == 1.0 and cross_metrics["distill/unaligned_tokens"] == 0.0


def test_build_teacher_follows_teacher_tokenizer(tmp_path, toks, bpe_teacher):
    from transformers import AutoModelForCausalLM

    char, _ = toks
    path, _, _ = bpe_teacher
    student_path = build_tiny_model(tmp_path / "s", hidden_size=32, num_layers=1)
    student = AutoModelForCausalLM.from_pretrained(student_path)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="distillation.teacher.path: the teacher's vocabulary.*teacher_tokenizer: auto"):
        build_teacher(DistillConfig(teacher={"path": path}), student, char, cpu)
    cross = build_teacher(DistillConfig(teacher={"path": path}, teacher_tokenizer="auto"), student, char, cpu)
    assert isinstance(cross, CrossTokenizerTeacher) and len(cross.teacher_tokenizer) == 400
    same = build_teacher(DistillConfig(teacher={"path": student_path}, teacher_tokenizer="auto"), student, char, cpu)
    assert type(same) is Teacher
    given = build_teacher(DistillConfig(teacher={"path": path}, teacher_tokenizer=path), student, char, cpu)
    assert isinstance(given, CrossTokenizerTeacher)
    with pytest.raises(ConfigError, match="distillation.teacher_tokenizer: the tokenizer has 103 tokens"):
        small = build_tiny_model(tmp_path / "small", hidden_size=32, num_layers=1)
        build_teacher(DistillConfig(teacher={"path": _shrunk(small, tmp_path)}, teacher_tokenizer=small),
                      student, build_bpe_tokenizer(), cpu)
    with pytest.raises(ConfigError, match="distillation.teacher_tokenizer: cannot load a tokenizer"):
        build_teacher(DistillConfig(teacher={"path": path}, teacher_tokenizer=str(tmp_path / "none")), student,
                      char, cpu)


def _shrunk(path: str, tmp_path) -> str:
    """The model at `path` with a 64-token vocabulary (smaller than its tokenizer's 103)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(64)
    model.save_pretrained(tmp_path / "shrunk")
    return str(tmp_path / "shrunk")
