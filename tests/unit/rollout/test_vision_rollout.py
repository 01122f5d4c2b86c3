"""A GRPO run of a tiny vision-language model from a TRL-format dataset: a bad image fails its own row only."""

from __future__ import annotations

import json

import pytest

Image = pytest.importorskip("PIL.Image")


def _rows(tmp_path):
    from datasets import Dataset

    good = tmp_path / "red.png"
    Image.new("RGB", (32, 32), (255, 0, 0)).save(good)
    prompt = [{"role": "user", "content": "colour?"}]
    images = [[str(good)], [str(tmp_path / "gone.png")], [str(good)], [str(good)]]
    return Dataset.from_dict({"prompt": [prompt] * 4, "images": images, "answer": ["r"] * 4})


def test_a_missing_image_fails_its_own_row_with_the_reason_in_events(tmp_path, tiny_vlm_path):
    import tokenmill

    def starts_with_answer(completions, answer, **kwargs):
        return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    out = tmp_path / "run"
    result = tokenmill.train({
        "model": {"path": tiny_vlm_path},
        "generation": {"group_size": 2, "max_tokens": 3},
        "controller": {"steps": 2, "prompts_per_step": 4},
        "data": {"shuffle": False},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0},
    }, rewards=[starts_with_answer], dataset=_rows(tmp_path))
    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    errors = [x for x in lines if x["event"] == "image_error"]
    assert len(errors) == 2  # row 1 in each of the two steps (4 rows a step, 4 rows in the set)
    assert errors[0]["reason"].startswith("row 1 of 4 drawn: image ") and "gone.png" in errors[0]["reason"]
    assert "no such file" in errors[0]["reason"]
    assert result["last_metrics"]["reward/unscored"] == 2  # that row's two samples; the other three rows trained
    final = out / "final"
    assert (final / "preprocessor_config.json").is_file()  # the export loads back as a vision-language model


def test_images_for_a_text_model_are_refused_naming_the_fields(tmp_path, tiny_model_path):
    import tokenmill
    from tokenmill.types import ConfigError

    with pytest.raises(ConfigError, match=r"model.path: the prompts have images \(data.image_column 'images'"):
        tokenmill.train({"model": {"path": tiny_model_path}, "controller": {"steps": 1},
                         "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"}},
                        rewards=[lambda completions, **_: [0.0] * len(completions)], dataset=_rows(tmp_path))
