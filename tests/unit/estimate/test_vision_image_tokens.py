"""Image tokens per picture in the memory estimate: the image processor's resize, patch and merge sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.estimate.vision import ImageGrid


@pytest.mark.parametrize(("height", "width"), [(448, 448), (24, 40), (30, 100), (640, 480), (9, 1000)])
def test_tokens_equal_the_tiny_processors_grid(qwen3_vl_path, height, width):
    from PIL import Image
    from transformers import AutoImageProcessor

    from tokenmill.estimate.model_specs import resolve_shape

    processor = AutoImageProcessor.from_pretrained(qwen3_vl_path)
    grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
    assert resolve_shape(qwen3_vl_path).image_grid.tokens(height, width) == int(grid.prod()) // processor.merge_size ** 2


def test_the_real_processors_sizes():
    """Qwen2.5-VL (patch 14) and Qwen3-VL (patch 16, `size` as pixel bounds) on the same pictures."""
    qwen25 = ImageGrid.from_processor({"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056},
                                      {})
    qwen3 = ImageGrid.from_processor({"patch_size": 16, "merge_size": 2,
                                      "size": {"shortest_edge": 65536, "longest_edge": 16777216}}, {})
    assert (qwen25.tokens(448, 448), qwen3.tokens(448, 448)) == (256, 196)
    assert (qwen25.tokens(1080, 1920), qwen3.tokens(1080, 1920)) == (39 * 69, 34 * 60)
    assert qwen3.tokens(64, 64) == 64  # under min_pixels: scaled up to 256 x 256
    assert ImageGrid(8, 2, 256, 4096).resized(640, 480) == (64, 48)  # over max_pixels: scaled down


def test_images_add_prompt_tokens_to_the_estimate(qwen3_vl_path):
    from tokenmill.estimate.config import estimate_for_config

    base = {"model": {"path": qwen3_vl_path, "device": "cpu"}, "data": {"task": "shapes"}}
    text_only = estimate_for_config(base | {"estimate": {"prompt_tokens": 100}})
    with_images = estimate_for_config(base | {"estimate": {"prompt_tokens": 100, "images_per_prompt": 3,
                                                           "image_size": [640, 480]}})
    assert with_images["vision"] == {"params": 73_056, "image_size": [640, 480], "image_tokens": 12,
                                     "images_per_prompt": 3}
    assert (text_only["settings"]["prompt_tokens"], with_images["settings"]["prompt_tokens"]) == (100, 136)
    assert text_only["vision"]["image_tokens"] == 16  # the default 448 x 448, scaled to 64 x 64
    assert json.loads((Path(qwen3_vl_path) / "config.json").read_text())["model_type"] == "qwen3_vl"


def test_a_bad_image_size_names_the_field(qwen3_vl_path):
    from tokenmill.estimate.config import estimate_for_config
    from tokenmill.types import ConfigError

    base = {"model": {"path": qwen3_vl_path, "device": "cpu"}, "data": {"task": "shapes"}}
    with pytest.raises(ConfigError, match="estimate.image_size"):
        estimate_for_config(base | {"estimate": {"image_size": [0, 448]}})
