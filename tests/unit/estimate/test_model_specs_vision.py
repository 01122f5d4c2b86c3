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


def test_the_shape_counts_every_parameter_of_a_qwen3_vl(qwen3_vl_path):
    """Qwen3-VL: a Qwen3 language model under `text_config`, LayerNorm / GELU blocks, a learned position grid
    and deepstack mergers in the tower."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.estimate.model_specs import resolve_shape

    model = AutoModelForImageTextToText.from_pretrained(qwen3_vl_path)
    shape = resolve_shape(qwen3_vl_path)
    assert model.config.vision_config.deepstack_visual_indexes == [0] and shape.qk_norm
    assert shape.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    # tied embeddings: the language model's parameters are the whole causal LM's
    assert shape.num_params - shape.vision_params == sum(p.numel() for p in model.model.language_model.parameters())
    assert shape.num_params == sum(p.numel() for p in model.parameters())


# Qwen3-VL-8B-Instruct's config.json (the fields that shape parameters; token ids and rotary settings as shipped)
QWEN3_VL_8B = {
    "model_type": "qwen3_vl", "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "intermediate_size": 12288,
                    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 151936, "attention_bias": False, "tie_word_embeddings": False,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000},
    "vision_config": {"model_type": "qwen3_vl_vision", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_heads": 16, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                      "out_hidden_size": 4096, "in_channels": 3, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
}


def test_qwen3_vl_8b_matches_transformers_on_the_meta_device():
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tokenmill.estimate.model_specs import shape_from_hf_config

    config = Qwen3VLConfig(**{k: v for k, v in QWEN3_VL_8B.items() if k != "model_type"})
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    shape = shape_from_hf_config(QWEN3_VL_8B)
    visual = sum(p.numel() for p in model.model.visual.parameters())
    assert shape.vision_params == visual == 576_388_336
    assert shape.num_params - shape.vision_params == (sum(p.numel() for p in model.model.language_model.parameters())
                                                      + model.lm_head.weight.numel())
    assert shape.num_params == sum(p.numel() for p in model.parameters()) == 8_767_123_696
    # the image processor's patch 16 merged 2 x 2 (from the vision config when no preprocessor_config.json)
    assert shape.image_grid.tokens(448, 448) == 196


def test_the_shape_counts_every_parameter_of_a_qwen2_vl(qwen2_vl_path):
    """Qwen2-VL: LayerNorm / GELU blocks `embed_dim` wide, the merger to the text width (`hidden_size`)."""
    from transformers import AutoModelForImageTextToText

    from tokenmill.estimate.model_specs import resolve_shape

    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_path)
    shape = resolve_shape(qwen2_vl_path)
    assert shape.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_qwen2_vl_7b_tower_matches_transformers_on_the_meta_device():
    """Qwen2-VL-7B-Instruct's `vision_config` as shipped (`in_chans`, `hidden_size` the text width)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from tokenmill.estimate.vision import vision_tower_params

    vision = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = Qwen2VLConfig(vision_config=vision, text_config={"hidden_size": 3584, "num_hidden_layers": 1,
                           "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 64,
                           "vocab_size": 32})
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    assert vision_tower_params(vision) == sum(p.numel() for p in model.model.visual.parameters())
