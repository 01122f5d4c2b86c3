"""The tiny vision-language kit: a Qwen2.5-VL folder that loads back through the Auto classes, offline."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_folder_loads_back_as_a_qwen25_vl_with_its_processor(tiny_vlm_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    config = json.loads((Path(tiny_vlm_path) / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["vision_config"]["patch_size"] == 8
    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    assert tok.convert_ids_to_tokens(model.config.image_token_id) == "<|image_pad|>"
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|user|><|vision_start|><|image_pad|><|vision_end|>hi<|end|><|assistant|>"
    assert tok.decode(tok("a b")["input_ids"]) == "a b"
    processor = AutoImageProcessor.from_pretrained(tiny_vlm_path)
    assert processor.merge_size == 2 and processor.patch_size == 8


def test_the_kit_builds_a_qwen3_vl_with_deepstack_and_interleaved_positions(tmp_path):
    import pytest
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from tokenmill.recipes.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / "q3", hidden_size=32, family="qwen3_vl")
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["vision_config"]["deepstack_visual_indexes"] == [0]
    rope = config["text_config"]["rope_parameters"]
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) == 32 // 4 // 2
    assert len(model.model.visual.deepstack_merger_list) == 1
    assert AutoImageProcessor.from_pretrained(path).patch_size == 8
    with pytest.raises(ValueError, match="family 'llava': one of qwen2_5_vl, qwen2_vl, qwen3_vl"):
        build_tiny_vlm(tmp_path / "x", family="llava")
