"""Build a tiny vision-language model locally: a random-init Qwen2.5-VL, Qwen2-VL or Qwen3-VL of the real
architecture (its vision tower, merger, Qwen3-VL's deepstack mergers and multimodal rotary positions) with the
character tokenizer and a Qwen2-VL image processor (the one all three use), saved as a normal HF folder. Nothing is downloaded; load it back with `from_pretrained`.

    >>> path = build_tiny_vlm("/tmp/tiny-vlm")                                    # doctest: +SKIP
    >>> AutoModelForImageTextToText.from_pretrained(path)                         # doctest: +SKIP

The image processor cuts images into `patch_size` pixel patches and the merger joins 2 x 2 of them into one
image token, so a 32 x 32 picture is 16 patches and 4 image tokens (an image is resized to a multiple of
`patch_size x merge_size` pixels between `min_pixels` and `max_pixels`).
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.recipes.tiny import build_tokenizer, save_folder

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# the tiny chat template, with Qwen2-VL's image markers for `{"type": "image"}` content parts
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# family -> (config class, model class) in transformers
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
            "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")}


def build_vlm_tokenizer():
    """The character tokenizer with Qwen2-VL's image tokens and a chat template that renders image parts."""
    tok = build_tokenizer(VISION_TOKENS)
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def build_tiny_vlm(path: str | Path, hidden_size: int = 64, num_layers: int = 2, *, vision_hidden_size: int = 32,
                   vision_depth: int = 2, patch_size: int = 8, image_pixels: tuple[int, int] = (16 * 16, 64 * 64),
                   seed: int = 0, num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 512,
                   family: str = "qwen2_5_vl") -> str:
    """Write a random-init Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`; `family="qwen2_vl"`: a Qwen2-VL,
    `family="qwen3_vl"`: a Qwen3-VL), the character tokenizer with image tokens and a `Qwen2VLImageProcessor`
    config to `path`; return the path. `image_pixels`: the processor's (min_pixels, max_pixels)."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    tok = build_vlm_tokenizer()
    head_dim = hidden_size // num_heads
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"), VISION_TOKENS,
        strict=True)}
    config_name, model_name = FAMILIES[family]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    text = {"head_dim": head_dim} if family == "qwen3_vl" else {}
    config = config_class(
        text_config={
            "vocab_size": len(tok), "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": max_positions, "tie_word_embeddings": True,
            "rope_parameters": rope_parameters(family, head_dim),
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None, **text,
        },
        vision_config=vision_config(family, vision_depth, vision_hidden_size, patch_size, hidden_size),
        tie_word_embeddings=True,
        **ids,
    )
    torch.manual_seed(seed)
    model = model_class(config).float()
    path = save_folder(model, tok, path)
    image_processor(patch_size, *image_pixels).save_pretrained(path)
    return str(path)


def rope_parameters(family: str, head_dim: int) -> dict:
    """The language model's multimodal rotary split of `head_dim / 2` frequencies over (time, height, width):
    Qwen2.5-VL's 1/4, 3/8, 3/8 in blocks; Qwen3-VL's 24:20:20 interleaved."""
    half = head_dim // 2
    if family == "qwen3_vl":
        spatial = 5 * half // 16
        return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * spatial, spatial, spatial],
                "mrope_interleaved": True}
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
    section[0] += half - sum(section)
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}


def vision_config(family: str, depth: int, width: int, patch_size: int, out_width: int) -> dict:
    """The vision tower's config: Qwen2.5-VL's (RMSNorm, SwiGLU, windowed attention), Qwen2-VL's, or Qwen3-VL's
    (learned position grid of 8 x 8 resampled to each image, the first block's features fed to the language
    model's first layer through a deepstack merger)."""
    shared = {"depth": depth, "num_heads": 2, "patch_size": patch_size, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "in_channels": 3}
    if family == "qwen2_vl":
        return {**shared, "embed_dim": width, "hidden_size": out_width, "mlp_ratio": 2}
    if family == "qwen3_vl":
        return {**shared, "hidden_size": width, "intermediate_size": 2 * width, "out_hidden_size": out_width,
                "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    return {**shared, "hidden_size": width, "intermediate_size": 2 * width, "out_hidden_size": out_width,
            "window_size": 4 * patch_size, "fullatt_block_indexes": [depth - 1]}


def image_processor(patch_size: int, min_pixels: int, max_pixels: int):
    """A Qwen2-VL image processor (the PIL one: it needs no torchvision) for `patch_size` patches merged 2 x 2,
    pixels scaled to [-1, 1]."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, temporal_patch_size=2, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
