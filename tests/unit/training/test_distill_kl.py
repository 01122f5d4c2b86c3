"""On-policy distillation's full reverse KL (`distillation.loss: full`): the per-position KL and its gradient
on a 3-token vocabulary against hand-computed values, and the trainer's chunked, padded and packed paths
against the plain formula on a tiny model (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.config.distill import DistillConfig, full_kl
from tokenmill.testing.samples import uneven_groups
from tokenmill.training import LocalBackend, collate
from tokenmill.training.logprobs import reverse_kl, sequence_token_stats, token_reverse_kl

LN2 = math.log(2.0)


def test_reverse_kl_and_its_gradient_on_three_tokens_equal_hand_computed_values():
    """p_s = (1/2, 1/4, 1/4), p_t = (1/4, 1/2, 1/4): KL = 1/2 ln 2 + 1/4 ln(1/2) + 0 = ln2 / 4, and
    d KL / d z_v = p_s(v) (ln p_s(v) - ln p_t(v) - KL) = (3/8, -5/16, -1/16) ln 2."""
    z = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.25]], dtype=torch.float64)) + 7.0  # logits: any shift
    kl = reverse_kl(torch.log_softmax(z, -1), teacher)
    assert float(kl.detach()) == pytest.approx(LN2 / 4, abs=1e-7)  # the teacher's log-softmax runs in fp32
    kl.sum().backward()
    assert z.grad[0].tolist() == pytest.approx([3 / 8 * LN2, -5 / 16 * LN2, -1 / 16 * LN2], abs=1e-7)
    # the same distributions: zero KL, zero gradient
    same = reverse_kl(torch.log_softmax(teacher.clone().requires_grad_(True), -1), teacher)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-7)


def test_plain_path_divides_the_students_logits_by_the_temperature_only():
    """At temperature 2 the student's logits 2 ln(2, 1, 1) give softmax = (1/2, 1/4, 1/4); the teacher stays
    at temperature 1 (1/4, 1/2, 1/4): the KL at the position is ln2 / 4 again; position 0 predicts nothing."""
    student = torch.log(torch.tensor([2.0, 1.0, 1.0]))[None, None].expand(1, 2, 3) * 2.0
    teacher = torch.log(torch.tensor([0.25, 0.5, 0.25]))[None, None].expand(1, 2, 3)
    kl = token_reverse_kl(student, teacher, temperature=2.0)
    assert kl[0].tolist() == pytest.approx([0.0, LN2 / 4], abs=1e-6)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "m", hidden_size=48, num_layers=2, seed=3)


def test_trainer_kl_and_gradient_equal_the_plain_formula_padded_packed_and_chunked(tiny_model_path, teacher_path,
                                                                                  tokenizer):
    """The backend's loss with a `distill_teacher` is the policy loss plus coef x sum_t w_t KL_t, where KL_t
    is the plain full-logits formula of both models: equal values and gradients whether rows are padded or
    packed by shared prompt, with the head in chunks of 3 positions or whole."""
    samples = uneven_groups(0, len(tokenizer), ((2, 4, 7), (4, 3, 7), (5, 2, 7)))
    batch = collate(samples, [0.1] * len(samples), pad_id=0)
    teacher = _load(teacher_path).eval().requires_grad_(False)
    with torch.no_grad():
        student_logits = _load(tiny_model_path)(input_ids=batch.input_ids_B_T).logits
        teacher_logits = teacher(input_ids=batch.input_ids_B_T).logits
    want_B_T = token_reverse_kl(student_logits, teacher_logits, 0.7)
    # the plain path by hand on one position: sum_v p_s (log p_s - log p_t)
    logp = torch.log_softmax(student_logits[0, 2] / 0.7, -1)
    by_hand = float((logp.exp() * (logp - torch.log_softmax(teacher_logits[0, 2], -1))).sum())
    assert float(want_B_T[0, 3]) == pytest.approx(by_hand, rel=1e-5) and by_hand > 0.01  # random models: near uniform
    expected = float((want_B_T * batch.weights_B_T).sum())
    grads = {}
    for share, chunk in ((False, 0), (False, 3), (True, 3), (True, 0)):
        model = _load(tiny_model_path)
        backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, temperature=0.7, share_prompts=share,
                               logits_chunk_mib=chunk * 4 * model.config.vocab_size / 2**20,
                               distill_teacher=teacher, distill_coef=0.5)
        metrics = backend.forward_backward(batch, lambda lp, b: ((lp * 0).sum(), {}))
        assert metrics["distill/reverse_kl"] == pytest.approx(expected, rel=1e-5), (share, chunk)
        assert metrics["loss"] == pytest.approx(0.5 * expected, rel=1e-5)
        grads[share, chunk] = [p.grad.clone() for p in model.parameters()]
    model = _load(tiny_model_path)  # the hand-written loss through full logits
    logits = model(input_ids=batch.input_ids_B_T).logits
    (0.5 * (token_reverse_kl(logits, teacher_logits, 0.7) * batch.weights_B_T).sum()).backward()
    for key, got in grads.items():
        for g, w in zip(got, (p.grad for p in model.parameters()), strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
    assert sum(float(g.abs().sum()) for g in grads[False, 0]) > 0


@pytest.mark.parametrize("k", [3, "vocab"])
def test_top_k_teacher_gives_the_bucketed_kl_and_the_full_kl_when_k_covers_the_vocabulary(
        tiny_model_path, teacher_path, tokenizer, k):
    """A `TopKTeacher` (an in-process engine asked for its top k, as a server would be): the trainer's term is
    the bucketed KL of the plain formula on the teacher's own top-k (values and gradients, chunked); with k the
    whole vocabulary it is the full KL of the module teacher."""
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.training.teacher import TopKTeacher

    samples = uneven_groups(1, len(tokenizer), ((3, 3, 6), (2, 2, 6)))
    batch = collate(samples, [0.2] * len(samples), pad_id=0)
    teacher = _load(teacher_path).eval().requires_grad_(False)
    vocab = teacher.config.vocab_size
    k = vocab if k == "vocab" else k
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch.input_ids_B_T).logits
    top_B_T_K, ids_B_T_K = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    shifted = (torch.nn.functional.pad(ids_B_T_K[:, :-1], (0, 0, 1, 0)),  # index t predicts token t
               torch.nn.functional.pad(top_B_T_K[:, :-1], (0, 0, 1, 0)))
    model = _load(tiny_model_path)
    want = token_reverse_kl(model(input_ids=batch.input_ids_B_T).logits, teacher_logits if k == vocab else shifted,
                            1.0)
    (want * batch.weights_B_T).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    student = _load(tiny_model_path)
    backend = LocalBackend(student, learning_rate=1e-3, total_steps=1, logits_chunk_mib=3 * 4 * vocab / 2**20,
                           distill_teacher=TopKTeacher(HFEngine(teacher, tokenizer), k))
    metrics = backend.forward_backward(batch, lambda lp, b: ((lp * 0).sum(), {}))
    assert metrics["distill/reverse_kl"] == pytest.approx(float((want * batch.weights_B_T).sum().detach()), rel=1e-4)
    assert metrics["distill/reverse_kl"] > 0.001
    for got, w in zip((p.grad for p in student.parameters()), want_grads, strict=True):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-4)


def test_sequence_stats_without_a_teacher_keep_two_tensors(tiny_model_path):
    ids = torch.tensor([[3, 4, 5, 6]])
    assert len(sequence_token_stats(_load(tiny_model_path), ids, temperature=1.0, chunk_bytes=0)) == 2


def test_loss_full_needs_one_in_process_teacher_and_auto_picks_it_where_it_can():
    from tokenmill.config import RLConfig, load_config
    from tokenmill.types import ConfigError

    with pytest.raises(ValueError, match="loss: 'full' needs"):
        DistillConfig(teacher={"url": "http://127.0.0.1:1"}, loss="full")
    with pytest.raises(ValueError, match="loss: 'full' needs"):
        DistillConfig(teachers={"a": {"path": "t"}, "b": {"path": "u"}}, loss="full")
    assert DistillConfig(teacher={"url": "http://127.0.0.1:1"}, loss="full", top_k=5).top_k == 5  # bucketed

    def cfg(backend="local", **dist):
        return load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"}, "algorithm": {"advantage": "distill"},
                                      "generation": {"group_size": 1}, "training": {"backend": backend},
                                      "distillation": dist})

    assert full_kl(cfg(teacher={"path": "t"}))
    assert not full_kl(cfg(teacher={"path": "t"}, loss="sampled"))
    assert not full_kl(cfg(teacher={"url": "http://127.0.0.1:1"}))
    assert not full_kl(cfg(teacher={"path": "t"}, top_k=4))
    assert not full_kl(cfg("fsdp2", teacher={"path": "t"}))  # auto: the sharded trainer takes the sampled estimate
    with pytest.raises(ConfigError, match="distillation.loss: 'full' computes the teacher's distribution inside"):
        cfg("fsdp2", teacher={"path": "t"}, loss="full")
