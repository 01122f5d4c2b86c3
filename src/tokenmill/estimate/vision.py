"""A vision-language model's share of the memory estimate: its vision tower's parameters in closed form
(Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's layouts) and the image tokens one picture becomes.

The Qwen2-VL image processor (which Qwen2.5-VL and Qwen3-VL use too) resizes a picture to multiples of
`patch_size x merge_size` pixels whose area lies between `min_pixels` and `max_pixels`, cuts it into
`patch_size` patches, and the merger joins `merge_size x merge_size` patches into one image token:

    >>> ImageGrid(patch_size=14, merge_size=2).tokens(448, 448)      # Qwen2.5-VL
    256
    >>> ImageGrid(patch_size=16, merge_size=2).tokens(448, 448)      # Qwen3-VL
    196
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# the Qwen2-VL image processor's defaults
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def config_int(config: dict[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{source}: config.json needs a positive integer {key!r} (got {value!r})")
    return value


@dataclass(frozen=True)
class ImageGrid:
    """How the image processor turns a picture into image tokens."""

    patch_size: int
    merge_size: int = 2
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the processor resizes a picture to: each side rounded to a multiple of
        `patch_size x merge_size`, then scaled (keeping the aspect) into [min_pixels, max_pixels]."""
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of one `height x width` picture (a still image: one temporal patch)."""
        h, w = self.resized(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    @classmethod
    def from_processor(cls, processor: dict[str, Any], vision: dict[str, Any]) -> ImageGrid:
        """From a `preprocessor_config.json` dict (its `patch_size`, `merge_size` and pixel bounds, either as
        `min_pixels` / `max_pixels` or as `size: {shortest_edge, longest_edge}`), the vision config filling
        in what it lacks."""
        size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
        return cls(
            patch_size=int(processor.get("patch_size") or vision.get("patch_size") or 14),
            merge_size=int(processor.get("merge_size") or vision.get("spatial_merge_size") or 2),
            min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
            max_pixels=int(processor.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
        )


def _linear(d_in: int, d_out: int) -> int:
    return d_in * d_out + d_out


def qwen25_vl_tower_params(vision: dict[str, Any], name: str = "model") -> int:
    """Parameters of a Qwen2.5-VL vision tower: the patch embedding (a bias-free Conv3d over temporal x patch x
    patch pixels), `depth` blocks (two RMSNorms, qkv and output projections with biases, a SwiGLU MLP with
    biases) and the merger (an RMSNorm, then two linears with biases from merge² patches to the text width)."""
    h = config_int(vision, "hidden_size", f"{name} vision_config")
    inter = config_int(vision, "intermediate_size", f"{name} vision_config")
    patch, temporal = config_int(vision, "patch_size", name), int(vision.get("temporal_patch_size", 2))
    merged = h * int(vision.get("spatial_merge_size", 2)) ** 2
    embed = int(vision.get("in_channels", 3)) * temporal * patch * patch * h
    block = 2 * h + _linear(h, 3 * h) + _linear(h, h) + 2 * _linear(h, inter) + _linear(inter, h)
    merger = h + _linear(merged, merged) + _linear(merged, config_int(vision, "out_hidden_size", name))
    return embed + config_int(vision, "depth", name) * block + merger


def qwen3_vl_tower_params(vision: dict[str, Any], name: str = "model") -> int:
    """Parameters of a Qwen3-VL vision tower: the patch embedding (a Conv3d with bias), the learned position
    grid (`num_position_embeddings` x width), `depth` blocks (two LayerNorms, qkv and output projections, a
    two-linear GELU MLP, all with biases), the merger (a LayerNorm over one patch, then two linears from merge²
    patches to `out_hidden_size`) and one deepstack merger per `deepstack_visual_indexes` entry (the same
    linears after a LayerNorm over the merge² patches)."""
    h = config_int(vision, "hidden_size", f"{name} vision_config")
    inter = config_int(vision, "intermediate_size", f"{name} vision_config")
    out = config_int(vision, "out_hidden_size", f"{name} vision_config")
    patch, temporal = config_int(vision, "patch_size", name), int(vision.get("temporal_patch_size", 2))
    merged = h * int(vision.get("spatial_merge_size", 2)) ** 2
    embed = _linear(int(vision.get("in_channels", 3)) * temporal * patch * patch, h)
    positions = config_int(vision, "num_position_embeddings", f"{name} vision_config") * h
    block = 4 * h + _linear(h, 3 * h) + _linear(h, h) + _linear(h, inter) + _linear(inter, h)
    mergers = _linear(merged, merged) + _linear(merged, out)
    deepstack = len(vision.get("deepstack_visual_indexes") or ())
    return (embed + positions + config_int(vision, "depth", name) * block + 2 * h + mergers
            + deepstack * (2 * merged + mergers))


def qwen2_vl_tower_params(vision: dict[str, Any], name: str = "model") -> int:
    """Parameters of a Qwen2-VL vision tower: the bias-free patch embedding to `embed_dim`, `depth` blocks (two
    LayerNorms, qkv and output projections, a GELU MLP `mlp_ratio` wide, all with biases) and the merger (a
    LayerNorm, then two linears from merge² patches to the text width, `hidden_size`)."""
    e = config_int(vision, "embed_dim", f"{name} vision_config")
    inter = int(e * float(vision.get("mlp_ratio", 4)))
    patch, temporal = config_int(vision, "patch_size", name), int(vision.get("temporal_patch_size", 2))
    merged = e * int(vision.get("spatial_merge_size", 2)) ** 2
    channels = int(vision.get("in_channels", vision.get("in_chans", 3)))
    block = 4 * e + _linear(e, 3 * e) + _linear(e, e) + _linear(e, inter) + _linear(inter, e)
    merger = 2 * e + _linear(merged, merged) + _linear(merged, config_int(vision, "hidden_size", name))
    return channels * temporal * patch * patch * e + config_int(vision, "depth", name) * block + merger


def vision_tower_params(vision: dict[str, Any], name: str = "model") -> int:
    """Parameters of a vision tower and its mergers: Qwen3-VL's layout when the config names it
    (`model_type: qwen3_vl_vision` or deepstack layers), Qwen2-VL's when it has an `embed_dim`, else
    Qwen2.5-VL's."""
    if vision.get("model_type") == "qwen3_vl_vision" or "deepstack_visual_indexes" in vision:
        return qwen3_vl_tower_params(vision, name)
    if "embed_dim" in vision:
        return qwen2_vl_tower_params(vision, name)
    return qwen25_vl_tower_params(vision, name)
