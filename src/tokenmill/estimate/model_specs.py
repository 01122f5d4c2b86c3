"""Model shapes for the memory estimator: from a Hugging Face `config.json` or from built-in specs.

A shape is the handful of numbers the memory formulas need (layers, widths, heads, vocabulary, tied
embeddings, biases). The parameter count is computed from them in closed form; a unit test checks it
against `numel()` of the same model built by transformers on the meta device.

    >>> shape = builtin_shape("Qwen/Qwen2.5-0.5B-Instruct")
    >>> shape.num_params
    494032768
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.estimate.vision import ImageGrid, config_int, vision_tower_params

# Families whose config carries the fields below and whose decoder layer is attention + SwiGLU MLP + 2 RMSNorms
SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral layout)."""

    name: str
    hidden_size: int  # h
    num_layers: int  # L
    num_heads: int  # n_h
    num_kv_heads: int  # n_kv
    head_dim: int  # d
    intermediate_size: int  # I
    vocab_size: int  # V
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    o_bias: bool = False  # Llama `attention_bias` also puts one on o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    vision_params: int = 0  # a vision-language model's vision tower and merger (`vision_tower_params`)
    image_grid: ImageGrid | None = None  # how its image processor turns a picture into image tokens

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each linear layer of one decoder layer, by module name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: linears (+ biases), two RMSNorms (+ Qwen3's q/k norms)."""
        dims = self.linear_dims()
        total = sum(d_in * d_out for d_in, d_out in dims.values())
        if self.qkv_bias or self.o_bias:
            total += dims["q_proj"][1] + dims["k_proj"][1] + dims["v_proj"][1]
        if self.o_bias:
            total += self.hidden_size
        total += 2 * self.hidden_size
        if self.qk_norm:
            total += 2 * self.head_dim
        return total

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when the output head is the (tied) embedding matrix: counted once, in the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Exact parameter count of the causal LM (embeddings, layers, final norm, untied head), plus a
        vision-language model's vision tower."""
        return (self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.lm_head_params
                + self.vision_params)

    def scalar_head_params(self, bias: bool) -> int:
        """The same backbone with a one-output head instead of the LM head (critic: bias; reward model: none)."""
        return self.num_params - self.lm_head_params + self.hidden_size + int(bias)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.num_params, "layers": self.num_layers, "hidden": self.hidden_size,
                "heads": self.num_heads, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate": self.intermediate_size, "vocab": self.vocab_size,
                "tied_embeddings": self.tie_word_embeddings}


def _qwen25(name: str, h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> ModelShape:
    return ModelShape(name, h, layers, heads, kv, h // heads, inter, vocab, tied, qkv_bias=True)


def _llama3(name: str, h: int, layers: int, heads: int, inter: int) -> ModelShape:
    return ModelShape(name, h, layers, heads, 8, h // heads, inter, 128256, False)


# Hand-entered from the models' config.json files (hidden, layers, heads, kv heads, MLP width, vocab, tied).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen25("Qwen/Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen25("Qwen/Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": _qwen25("Qwen/Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": _qwen25("Qwen/Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen25("Qwen/Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen25("Qwen/Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": _qwen25("Qwen/Qwen2.5-72B", 8192, 80, 64, 8, 29568, 152064, False),
    "llama-3-8b": _llama3("meta-llama/Meta-Llama-3-8B", 4096, 32, 32, 14336),
    "llama-3-70b": _llama3("meta-llama/Meta-Llama-3-70B", 8192, 80, 64, 28672),
}


def _spec_key(name: str) -> str:
    """'Qwen/Qwen2.5-7B-Instruct' -> 'qwen2.5-7b'; 'meta-llama/Llama-3.1-8B' -> 'llama-3-8b'."""
    key = name.strip().rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for suffix in ("-instruct", "-chat", "-base"):
        key = key.removesuffix(suffix)
    return key.replace("llama-3.1-", "llama-3-")  # 3.1 keeps 3's shapes (only RoPE scaling changed)


def builtin_shape(name: str) -> ModelShape | None:
    """The built-in spec for a hub-style name, or None."""
    return BUILTIN_SHAPES.get(_spec_key(name))


# vision-language families: their language model's family (read from `text_config`)
VISION_LANGUAGE_TYPES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


def shape_from_hf_config(config: dict[str, Any], name: str = "model",
                         processor: dict[str, Any] | None = None) -> ModelShape:
    """Read a `config.json` dict. Raises ValueError naming the missing or bad key. A Qwen2-VL / Qwen2.5-VL /
    Qwen3-VL config is its language model (`text_config`, or the top level: a Qwen2 / a Qwen3) plus its vision tower's parameters;
    `processor` (a `preprocessor_config.json` dict) sets how pictures become image tokens."""
    text_type = VISION_LANGUAGE_TYPES.get(str(config.get("model_type")))
    if text_type and isinstance(config.get("vision_config"), dict):
        text = {"tie_word_embeddings": config.get("tie_word_embeddings", False),
                **config.get("text_config", config), "model_type": text_type}
        vision = config["vision_config"]
        return replace(shape_from_hf_config(text, name), vision_params=vision_tower_params(vision, name),
                       image_grid=ImageGrid.from_processor(processor or {}, vision))
    model_type = str(config.get("model_type", "llama"))
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"{name}: model_type {model_type!r} is not supported by the memory estimate "
                         f"(dense {', '.join(SUPPORTED_TYPES)}, {', '.join(VISION_LANGUAGE_TYPES)} only)")
    h = config_int(config, "hidden_size", name)
    heads = config_int(config, "num_attention_heads", name)
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    return ModelShape(
        name=name,
        hidden_size=h,
        num_layers=config_int(config, "num_hidden_layers", name),
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=config_int(config, "intermediate_size", name),
        vocab_size=config_int(config, "vocab_size", name),
        # transformers' default for these families is untied
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's dict, or None when it is missing or unreadable (the estimate falls back to defaults)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def resolve_shape(source: str | dict[str, Any]) -> ModelShape:
    """A shape from a config dict, a model folder holding `config.json`, or a built-in spec name."""
    if isinstance(source, dict):
        return shape_from_hf_config(source)
    folder = Path(source).expanduser()
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{source}: cannot read config.json ({exc})") from None
        processor = _read_json(folder / "preprocessor_config.json")
        return shape_from_hf_config(config, name=str(source), processor=processor)
    shape = builtin_shape(source)
    if shape is None:
        known = ", ".join(s.name for s in BUILTIN_SHAPES.values())
        raise ValueError(f"{source!r} is neither a folder with config.json nor a built-in spec ({known})")
    return shape
