"""The memory estimate of a vision-language policy counts its vision tower (held, not trained, when frozen)."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_shape_counts_every_parameter_of_a_qwen25_vl(tiny_vlm_path):
    from transformers import AutoModelForImageTextToText

    from tokenmill.estimate.model_specs import resolve_shape

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_path)
    shape = resolve_shape(tiny_vlm_path)
    assert shape.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_a_real_sized_vision_tower_matches_transformers_on_the_meta_device(tiny_vlm_path):
    """Qwen2.5-VL-7B's vision tower (32 blocks, 1280 wide), built on the meta device."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tokenmill.estimate.model_specs import vision_tower_params

    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584, "in_channels": 3,
              "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
    config = Qwen2_5_VLConfig(vision_config=vision, text_config={"hidden_size": 3584, "num_hidden_layers": 1,
                              "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 64,
                              "vocab_size": 32})
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert vision_tower_params(vision) == sum(p.numel() for p in model.model.visual.parameters())


def test_a_frozen_tower_has_no_gradients_or_optimizer_state(tiny_vlm_path):
    from tokenmill.estimate.config import estimate_for_config

    base = {"model": {"path": tiny_vlm_path, "device": "cpu"}, "data": {"task": "shapes"}}
    frozen = estimate_for_config(base)
    trained = estimate_for_config({**base, "model": {**base["model"], "freeze_vision": False}})
    vision = json.loads((Path(tiny_vlm_path) / "config.json").read_text())["vision_config"]
    assert vision["depth"] == 2

    def actor(result):
        return next(m for m in result["models"] if m["role"] == "actor")

    assert actor(trained)["trainable_params"] - actor(frozen)["trainable_params"] > 50_000
    assert actor(frozen)["params"] == actor(trained)["params"]
