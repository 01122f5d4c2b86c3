"""Offline runs of a vision-language model from TRL's formats with an `images` column: SFT's loss (prompt /
completion rows or conversations) is the mean NLL of a plain forward with the pictures; DPO trains on pairs
with pictures; images for a text model and beside plain text are refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

Image = pytest.importorskip("PIL.Image")


def _sft_file(tmp_path, n=4):
    """prompt / completion rows with board pictures saved as files (TRL's prompt-completion format)."""
    from tokenmill.data.shapes import shapes_dataset

    rows = shapes_dataset(n, seed=0)
    lines = []
    for i, row in enumerate(rows):
        picture = tmp_path / f"board{i}.png"
        row["images"][0].save(picture)
        lines.append(json.dumps({"prompt": row["prompt"], "completion": row["completion"],
                                 "images": [str(picture)]}))
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sft_with_images_is_the_mean_nll_of_a_forward_with_the_pictures(tmp_path, tiny_vlm_path):
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    import tokenmill
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.testing.reference import image_token_logprobs
    from tokenmill.training.vision import image_sft_samples

    path = _sft_file(tmp_path)
    result = tokenmill.sft({"model": {"path": tiny_vlm_path}, "data": {"path": str(path)}, "steps": 1,
                            "batch_size": 8, "output_dir": str(tmp_path / "sft")})
    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    rows = load_dataset("json", data_files=str(path), split="train")
    samples = image_sft_samples(VisionProcessor.from_pretrained(tiny_vlm_path, tokenizer=tok), rows)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path).eval()
    nll = [-image_token_logprobs(model, s.tokens, s.images)[s.prompt_len - 1 :] for s in samples]
    want = float(torch.cat(nll).mean())  # token mean over every completion token of the batch
    assert abs(result["losses"][0] - want) < 1e-5
    text_only = [-image_token_logprobs(model, s.tokens, s.images.__class__(
        torch.zeros_like(s.images.pixel_values), s.images.image_grid_thw))[s.prompt_len - 1 :] for s in samples]
    assert abs(float(torch.cat(text_only).mean()) - want) > 1e-4  # other pixels, another loss: the pictures count


def test_dpo_from_a_vision_preference_dataset_trains(tmp_path, tiny_vlm_path):
    import tokenmill
    from tokenmill.data.shapes import shapes_preferences

    pairs = tmp_path / "pairs"
    shapes_preferences(16, seed=0).save_to_disk(str(pairs))
    result = tokenmill.preference({"model": {"path": tiny_vlm_path}, "data": {"path": str(pairs)}, "steps": 4,
                                   "batch_size": 16, "beta": 0.5, "learning_rate": 3e-3, "warmup_steps": 0,
                                   "output_dir": str(tmp_path / "dpo")})
    assert result["losses"][0] == pytest.approx(0.6931, abs=1e-4) and result["losses"][-1] < result["losses"][0]


def test_sft_on_vision_conversations_trains_the_assistant_tokens_with_the_pictures(tmp_path, tiny_vlm_path):
    """TRL's vision conversation format (`messages` with an image part, `images` beside it): the loss is the mean
    NLL of the assistant's tokens under a forward with the pictures, the image tokens laid out as the
    processor does and never trained."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    import tokenmill
    from tokenmill.engines.local.vision import VisionProcessor
    from tokenmill.testing.reference import image_token_logprobs

    rows = [json.loads(x) for x in _sft_file(tmp_path, 3).read_text().splitlines()]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": r["prompt"] + [{"role": "assistant", "content": r["completion"]}],
                                        "images": r["images"]}) + "\n" for r in rows))
    result = tokenmill.sft({"model": {"path": tiny_vlm_path}, "data": {"path": str(chat)}, "steps": 1,
                            "batch_size": 8, "output_dir": str(tmp_path / "sft")})
    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    processor = VisionProcessor.from_pretrained(tiny_vlm_path, tokenizer=tok)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path).eval()
    nll = []
    for r in rows:  # the prompt as the processor lays it out, then the assistant's answer and end of turn
        ids, images = processor.encode(r["prompt"], [Image.open(p) for p in r["images"]])
        answer = tok(r["completion"] + "<|end|>", add_special_tokens=False)["input_ids"]
        nll.append(-image_token_logprobs(model, ids + answer, images)[len(ids) - 1 :])
    assert abs(result["losses"][0] - float(torch.cat(nll).mean())) < 1e-5


def test_images_for_a_text_model_or_with_plain_text_are_refused(tmp_path, tiny_model_path, tiny_vlm_path):
    import tokenmill
    from tokenmill.types import ConfigError

    path = _sft_file(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"model\.path: the rows have images"):
        tokenmill.sft({"model": {"path": tiny_model_path}, "data": {"path": str(path)}, "steps": 1,
                       "output_dir": str(tmp_path / "a")})
    row = json.loads(path.read_text())
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "two shapes", "images": row["images"]}) + "\n")
    with pytest.raises(ConfigError, match=r"data: SFT with images takes prompt / completion rows or conversations"):
        tokenmill.sft({"model": {"path": tiny_vlm_path}, "data": {"path": str(text)}, "steps": 1,
                       "output_dir": str(tmp_path / "b")})
