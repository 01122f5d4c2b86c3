"""A vision-language distillation teacher scores the student's completions with the prompts' images: its
logprobs equal the teacher model's own forward with the pixels, and a distillation run on the shapes task
trains from them; what it cannot take yet is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vlm_teacher(tmp_path_factory):
    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm-teacher") / "model", hidden_size=32, seed=3)


def _student_samples(path, n=3):
    from transformers import AutoTokenizer

    from tokenmill.data.shapes import shapes_dataset
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.training.vision import image_sft_samples

    tok = AutoTokenizer.from_pretrained(path)
    return tok, image_sft_samples(VisionProcessor.from_pretrained(path, tokenizer=tok), shapes_dataset(n, seed=0))


def test_a_vision_teacher_scores_with_the_images_like_its_own_forward(tiny_vlm_path, vlm_teacher):
    from transformers import AutoModelForImageTextToText

    from tokenmill.config.distill import DistillConfig
    from tokenmill.testing.reference import image_token_logprobs
    from tokenmill.training.teacher import build_teacher
    from tokenmill.training.vision_roles import VisionScorer

    student = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path)
    tok, samples = _student_samples(tiny_vlm_path)
    dist = DistillConfig(teacher={"path": vlm_teacher}, loss="sampled")
    teacher = build_teacher(dist, student, tok, torch.device("cpu"))
    assert isinstance(teacher.scorers["teacher"], VisionScorer)
    scored = teacher.score(samples)
    model = AutoModelForImageTextToText.from_pretrained(vlm_teacher).eval()
    for s, got in zip(samples, scored, strict=True):
        want = image_token_logprobs(model, s.tokens, s.images)
        assert len(got.token_logprobs) == len(s.tokens) - 1
        assert torch.allclose(torch.tensor(got.token_logprobs), want, atol=1e-5)
    # other pictures behind the same tokens: other scores
    _, other = _student_samples(tiny_vlm_path, 6)
    swaps = [s.with_(images=o.images) for s in samples for o in other[3:]
             if o.images.image_grid_thw.tolist() == s.images.image_grid_thw.tolist()][:1]
    assert swaps
    moved = teacher.score(swaps)[0].token_logprobs
    same = teacher.score([next(s for s in samples if s.tokens == swaps[0].tokens)])[0].token_logprobs
    assert max(abs(a - b) for a, b in zip(moved, same, strict=True)) > 1e-4
    top = teacher.scorers["teacher"].score([list(samples[0].tokens)], top_k=3)[0]
    assert len(top.top_logprobs[0]) == 3


def test_distillation_on_the_shapes_task_with_a_vision_teacher(tmp_path, tiny_vlm_path, vlm_teacher):
    import tokenmill

    out = tmp_path / "run"
    tokenmill.train({
        "model": {"path": tiny_vlm_path},
        "data": {"task": "shapes", "num_train": 16, "num_eval": 0},
        "generation": {"group_size": 2, "max_tokens": 3},
        "algorithm": {"advantage": "distill"},
        "distillation": {"teacher": {"path": vlm_teacher}},  # auto: sampled, for a vision-language policy
        "training": {"learning_rate": 1e-2},
        "controller": {"steps": 3, "prompts_per_step": 4},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    })
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    teacher_lp = [r["distill/teacher_logprob"] for r in rows if "distill/teacher_logprob" in r]
    assert len(teacher_lp) == 3 and all(-50 < x < 0 for x in teacher_lp)


@pytest.mark.parametrize(("cfg", "field"), [
    ({"loss": "full"}, "distillation.loss"), ({"loss": "sampled", "top_k": 4}, "distillation.top_k"),
    ({"loss": "sampled", "url": "http://127.0.0.1:1"}, "distillation.teacher.url"),
    ({"loss": "sampled", "text": True}, "distillation.teacher.path"),
])
def test_what_a_vision_policy_cannot_distil_from_yet_is_refused(cfg, field, tiny_vlm_path, vlm_teacher,
                                                                tiny_model_path):
    from transformers import AutoModelForImageTextToText

    from tokenmill.config.distill import DistillConfig
    from tokenmill.training.teacher import build_teacher
    from tokenmill.types import ConfigError

    student = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path)
    tok, _ = _student_samples(tiny_vlm_path, 1)
    cfg = dict(cfg)
    where = {"url": cfg.pop("url")} if "url" in cfg else {"path": tiny_model_path if cfg.pop("text", False)
                                                           else vlm_teacher}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_teacher(DistillConfig(teacher=where, **cfg), student, tok, torch.device("cpu"))
