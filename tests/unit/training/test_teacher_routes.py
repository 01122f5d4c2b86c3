"""Multi-teacher distillation with two distinct tiny teachers: each sample is scored by the teacher its row
names (through `route_by`, the `routes` rule or `route_default`) and by no other, the per-token advantages and
the trainer's loss equal hand-computed values, per-teacher metrics, and data or config that route a row
nowhere are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config.distill import DistillConfig
from tokenmill.testing import build_tiny_model
from tokenmill.testing.distill import text_groups, trainer_loss
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.training.teacher import build_teacher, check_teacher_data, distill_groups
from tokenmill.types import ConfigError

ROWS = [({"prompt": "12+3=", "task": "add"}, ("15", "16")), ({"prompt": "9-4=", "task": "sub"}, ("5",)),
        ({"prompt": "20-7=", "task": "subtract"}, ("13",))]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("route_teachers")
    paths = [build_tiny_model(root / f"t{i}", hidden_size=32, num_layers=1, seed=20 + i) for i in range(2)]
    return {name: (p, AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval())
            for name, p in zip(("adder", "subtracter"), paths, strict=True)}


def _config(teachers, **extra) -> DistillConfig:
    return DistillConfig(teachers={n: {"path": p} for n, (p, _) in teachers.items()}, route_by="task",
                         routes={"add": "adder", "sub": "subtracter"}, **extra)


def test_each_sample_is_scored_by_its_own_teacher_and_the_loss_is_hand_computed(teachers, tiny_model, tokenizer):
    dist = _config(teachers, route_default="subtracter", kl_coef=2.0)
    teacher = build_teacher(dist, tiny_model, tokenizer, torch.device("cpu"))
    _, samples, metrics = distill_groups(text_groups(tiny_model, tokenizer, ROWS), teacher, dist)
    chosen = {"add": "adder", "sub": "subtracter", "subtract": "subtracter"}  # the last one by route_default
    per_teacher: dict[str, list[float]] = {"adder": [], "subtracter": []}
    for s in samples:
        prompt, completion = s.tokens[: s.prompt_len], s.tokens[s.prompt_len :]
        name = chosen[s.row["task"]]
        other = "subtracter" if name == "adder" else "adder"
        with torch.no_grad():
            mine = teacher_logprobs(teachers[name][1], prompt, completion)
            theirs = teacher_logprobs(teachers[other][1], prompt, completion)
        student = s.logprobs[s.prompt_len :]
        expected = [-2.0 * (st - t) for st, t in zip(student, mine, strict=True)]
        assert s.token_advantages[s.prompt_len :] == pytest.approx(expected, abs=1e-5)
        wrong = [-2.0 * (st - t) for st, t in zip(student, theirs, strict=True)]
        assert max(abs(a - b) for a, b in zip(s.token_advantages[s.prompt_len :], wrong, strict=True)) > 1e-2
        per_teacher[name] += [st - t for st, t in zip(student, mine, strict=True)]
    for name, ratios in per_teacher.items():
        assert metrics[f"distill/reverse_kl/{name}"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-5)
    # the trainer's clipped loss at ratio 1 (the sampler's logprobs are the policy's): -sum_t w_t A_t, with
    # token-mean weights 1 / 7 (seven completion tokens in all)
    assert sum(sum(s.loss_mask) for s in samples) == 7
    hand = -sum(sum(s.token_advantages) for s in samples) / 7
    assert trainer_loss(tiny_model, samples) == pytest.approx(hand, abs=1e-5)
    assert abs(hand) > 1e-2


def test_a_row_that_names_no_teacher_is_refused_naming_the_field(teachers, tiny_model, tokenizer):
    from datasets import Dataset

    dist = _config(teachers)
    teacher = build_teacher(dist, tiny_model, tokenizer, torch.device("cpu"))
    with pytest.raises(ConfigError, match="distillation.route_by: row column 'task' is 'subtract', which names no "
                                          "teacher .*distillation.routes or set distillation.route_default"):
        distill_groups(text_groups(tiny_model, tokenizer, ROWS), teacher, dist)
    rows = Dataset.from_dict({"prompt": ["1+2=", "5-1=", "4-4="], "task": ["add", "sub", "mul"]})
    with pytest.raises(ConfigError, match="distillation.route_by: rows whose 'task' is 'mul' name no teacher"):
        check_teacher_data(dist, rows)
    check_teacher_data(_config(teachers, route_default="adder"), rows)
    with pytest.raises(ConfigError, match="distillation.route_by: the data has no column 'task' "
                                          r"\(its columns: prompt\)"):
        check_teacher_data(dist, Dataset.from_dict({"prompt": ["1+2="]}))
    unrouted = text_groups(tiny_model, tokenizer, [({"prompt": "1+2="}, ("3",))])
    with pytest.raises(ConfigError, match="distillation.route_by: the row has no column 'task'"):
        distill_groups(unrouted, teacher, dist)


@pytest.mark.parametrize(("extra", "message"), [
    ({"routes": {"add": "multiplier"}}, "distillation: routes.add: 'multiplier' names no teacher"),
    ({"route_default": "nobody"}, "distillation: route_default: 'nobody' names no teacher"),
    ({"route_by": None, "routes": {"add": "a"}}, "distillation: routes / route_default: rules for route_by"),
])
def test_routing_rules_naming_no_teacher_are_refused_naming_the_field(extra, message):
    from tokenmill.config import RLConfig, load_config

    dist = {"teachers": {"a": {"path": "t"}, "b": {"path": "u"}}, "route_by": "task", **extra}
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, {"algorithm": {"advantage": "distill"}, "distillation": dist})
