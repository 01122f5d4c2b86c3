"""Self-distillation on a real tiny model: the teacher's logprobs are the policy's own on the privileged
prompt followed by the student's completion (built by hand), the per-token advantages and the trainer's loss
equal hand-computed values, a frozen `initial` snapshot does not follow the policy, and a template reading a
column the data lacks is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.testing.distill import char_ids, text_groups, trainer_loss
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.training.self_teacher import check_template, privileged_prompt
from tokenmill.training.teacher import build_teacher, check_teacher_data, distill_groups
from tokenmill.types import ConfigError

TEMPLATE = "{answer}|{prompt}"
ROWS = [({"prompt": "12+3=", "answer": "15"}, ("15", "16")), ({"prompt": "7+40=", "answer": "47"}, ("47",))]


def _self_distill(model, tokenizer, **extra):
    dist = DistillConfig(self_teacher={"template": TEMPLATE, **extra}, kl_coef=0.5)
    teacher = build_teacher(dist, model, tokenizer, torch.device("cpu"))
    return teacher, distill_groups(text_groups(model, tokenizer, ROWS), teacher, dist)


def test_teacher_logprobs_are_the_policy_on_the_privileged_prompt(tiny_model, tokenizer):
    _, (_, samples, metrics) = _self_distill(tiny_model, tokenizer)
    ratios = []
    for s in samples:
        privileged = char_ids(tokenizer, f"{s.row['answer']}|{s.row['prompt']}")  # "15|12+3=", by hand
        completion = s.tokens[s.prompt_len :]
        with torch.no_grad():
            teacher = teacher_logprobs(tiny_model, privileged, completion)
            plain = teacher_logprobs(tiny_model, s.tokens[: s.prompt_len], completion)
        assert s.logprobs[s.prompt_len :] == pytest.approx(plain, abs=1e-5)  # the student's side: the plain prompt
        assert max(abs(a - b) for a, b in zip(teacher, plain, strict=True)) > 1e-3  # the hint changes the target
        expected = [-0.5 * (st - t) for st, t in zip(plain, teacher, strict=True)]
        assert s.token_advantages[: s.prompt_len] == (0.0,) * s.prompt_len
        assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)
        ratios += [st - t for st, t in zip(plain, teacher, strict=True)]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-5)
    # the trainer's clipped loss at ratio 1 is -sum_t w_t A_t with w_t = 1 / (all completion tokens)
    tokens = sum(sum(s.loss_mask) for s in samples)
    hand = -sum(sum(s.token_advantages) for s in samples) / tokens
    assert trainer_loss(tiny_model, samples) == pytest.approx(hand, abs=1e-5)
    assert abs(hand) > 1e-3


def test_an_initial_snapshot_stays_frozen_while_the_policy_scores_with_its_current_weights(tiny_model, tokenizer):
    current, (_, samples, _) = _self_distill(tiny_model, tokenizer)
    frozen, _ = _self_distill(tiny_model, tokenizer, snapshot="initial")
    policy_before = [p.token_logprobs for p in current.score(samples)]
    frozen_before = [p.token_logprobs for p in frozen.score(samples)]
    assert frozen_before == policy_before  # the same weights, the same kernels
    with torch.no_grad():
        tiny_model.model.norm.weight.mul_(3.0)  # the policy moves on
    assert [p.token_logprobs for p in frozen.score(samples)] == frozen_before
    moved = [p.token_logprobs for p in current.score(samples)]
    assert max(abs(a - b) for x, y in zip(moved, policy_before, strict=True) for a, b in zip(x, y, strict=True)) > 1e-3


def test_chat_prompts_put_the_template_in_the_last_user_message():
    chat = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]
    out = privileged_prompt("hint {answer}: {prompt}", {"answer": "3"}, chat)
    assert out == [{"role": "system", "content": "add"}, {"role": "user", "content": "hint 3: 1+2="}]
    assert chat[1]["content"] == "1+2="  # the student's prompt is left alone


def test_a_template_column_the_data_lacks_is_refused_naming_the_field():
    from datasets import Dataset

    rows = Dataset.from_dict({"prompt": ["1+2="], "answer": ["3"]})
    check_template(DistillConfig(self_teacher={"template": TEMPLATE}).self_teacher, rows)
    with pytest.raises(ConfigError, match="distillation.self_teacher.template: the data has no column 'hint'"):
        check_teacher_data(DistillConfig(self_teacher={"template": "{hint} {prompt}"}), rows)
    with pytest.raises(ConfigError, match="distillation.self_teacher.template: the row has no column 'hint'"):
        privileged_prompt("{hint}", {"prompt": "1+2="}, "1+2=")
