"""The fast decode step: one token per row through a Llama-family model's own submodules.

A transformers forward does, for every decoded token, work that a one-token step does not need: its
wrappers (deprecated-argument checks, output capturing, config look-ups), the attention-mask construction,
the rotary tables recomputed from the positions, a dynamic cache that grows by concatenation. On a small
model that is most of a decode step. `FastDecoder.step` calls the same modules (embedding, norms,
projections, MLPs, head: LoRA-wrapped ones included, so adapters apply) but does the rest itself:
rotary tables read from a table computed once, the key/value states written into a preallocated buffer
(`StaticKV`), the attention run on the key/value heads (grouped queries packed, no repeat), the head applied
to the one new position only.

Same tokens and logprobs as the transformers forward (tests/unit/engines/test_fast_decode.py: 1e-5 in
fp32). Models it does not know (`fast_decode_blocker` names the reason) decode through transformers.

    >>> fast = FastDecoder(model)                                   # doctest: +SKIP
    >>> logits_B_V = fast.step(tok_B, pos_B, None, cache)           # doctest: +SKIP
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# decoder-layer classes whose forward is: x + attn(norm(x)); x + mlp(norm(x)) (q_norm / k_norm per head for
# Qwen3), full attention, rotary positions; the step below is that forward for one token
KNOWN_LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"})
# RMS norms that are `weight * (x / rms(x))` in fp32, cast back: one fused `F.rms_norm` computes the same
KNOWN_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def _causal_lm(model):
    """The transformers causal LM under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def has_forward_hooks(model) -> bool:
    """Hooks on the forward of the model, its decoder or a decoder layer (FSDP2's gathers, a user's hook), which
    a step that calls the layers' submodules would skip."""
    lm = _causal_lm(model)
    decoder = getattr(lm, "model", None)
    modules = [model, lm, decoder, *getattr(decoder, "layers", ())]
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)


def fast_decode_blocker(model) -> str | None:
    """Why `FastDecoder` cannot run this model (None: it can)."""
    lm = _causal_lm(model)
    if has_forward_hooks(model):
        return "hooks on the model's forward"
    decoder = getattr(lm, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, n) for n in needed):
        return f"{type(lm).__name__} has no Llama-style decoder (embed_tokens, layers, norm, rotary_emb)"
    kinds = {type(layer).__name__ for layer in decoder.layers}
    if not kinds <= KNOWN_LAYERS:
        return f"decoder layers {sorted(kinds - KNOWN_LAYERS)} are not ones the fast step knows"
    config = lm.config
    types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in types) or (
        bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
        and type(lm).__name__.startswith("Mistral"))
    if sliding:
        return "sliding-window attention layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rotary scaling (its frequencies depend on the sequence length)"
    if getattr(lm, "get_output_embeddings", lambda: None)() is None:
        return "no output embeddings"
    return None


class StaticKV:
    """Key/value states in preallocated `[B, heads, capacity, head_dim]` buffers, one pair per layer;
    `length` columns are filled. A step writes column `length` of every layer, then `advance()`s."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        self.keys, self.values, self.length = keys, values, length

    @classmethod
    def from_dynamic(cls, cache, extra: int, repeat: int = 1) -> StaticKV:
        """Copy a filled transformers `DynamicCache` into buffers `extra` columns wider, each row `repeat`ed
        (row i becomes rows i*repeat .. i*repeat + repeat - 1)."""
        keys, values = [], []
        length = cache.layers[0].keys.shape[2]
        for layer in cache.layers:
            for src, out in ((layer.keys, keys), (layer.values, values)):
                rows, heads, _, dim = src.shape
                # zeros, not garbage: a CUDA-graph step attends over every column, masked, and a masked NaN
                # still poisons the sum (0 x NaN)
                buf = src.new_zeros((rows * repeat, heads, length + extra, dim))
                buf.view(rows, repeat, heads, length + extra, dim)[:, :, :, :length] = src[:, None]
                out.append(buf)
        return cls(keys, values, length)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key.shape[2]
        self.keys[layer][:, :, self.length : end] = key
        self.values[layer][:, :, self.length : end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, columns: int = 1) -> None:
        self.length += columns

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep only the rows at `index` (finished rows leave the batch)."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]


class ColumnKV:
    """A `StaticKV`'s buffers written at the column held by the one-element device tensor `column`, with the
    attention over every column (the caller masks the ones not yet written): a step whose tensor shapes
    and addresses never change, which a CUDA graph can record once and replay (`engines.cuda_graphs`)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor) -> None:
        self.keys, self.values, self.column = keys, values, column

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]  # (a slice assignment would cast: so does this)
        keys.index_copy_(2, self.column, key.to(keys.dtype))
        values.index_copy_(2, self.column, value.to(values.dtype))
        return self.keys[layer], self.values[layer]

    def advance(self, columns: int = 1) -> None:
        """The caller moves `column` (and the `StaticKV` it views)."""


class _DynamicKV:
    """The step's view of a transformers `DynamicCache` (grows by concatenation; the continuous engine's)."""

    def __init__(self, cache) -> None:
        self.layers = cache.layers

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].update(key, value)

    def advance(self, columns: int = 1) -> None:
        """A DynamicCache's length is its tensors' own."""


class FastDecoder:
    """One-token decode steps over `model` (a transformers Llama-family causal LM, peft-wrapped or not)."""

    def __init__(self, model) -> None:
        reason = fast_decode_blocker(model)
        if reason is not None:
            raise ValueError(f"fast decode cannot run this model: {reason}")
        lm = _causal_lm(model)
        self.decoder = lm.model
        self.layers = list(self.decoder.layers[: lm.config.num_hidden_layers])
        self.head = lm.get_output_embeddings()
        self._cos = self._sin = None  # rotary tables [positions, head_dim], built on first use

    def _rotary(self, pos_B: torch.Tensor, like: torch.Tensor, need: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, 1, 1, head_dim]` of each row's position, read from tables the rotary module built
        once (the same numbers as its per-call output: each entry is one position's product, cos and sin).
        `need`: positions the tables must cover (None: read off `pos_B`, which waits for the device)."""
        need = int(pos_B.max()) + 1 if need is None else need
        if self._cos is None or self._cos.shape[0] < need or self._cos.dtype != like.dtype:
            size = max(need, 2 * (self._cos.shape[0] if self._cos is not None else 256))
            positions = torch.arange(size, device=pos_B.device)[None]
            cos, sin = self.decoder.rotary_emb(like, positions)
            half = cos.shape[-1] // 2  # rotate_half(x) * sin == x.roll(half) * (sin with its first half negated)
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self._cos[pos_B][:, None, None, :], self._sin[pos_B][:, None, None, :]

    def step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, mask_B_K: torch.Tensor | None, cache,
             positions: int | None = None) -> torch.Tensor:
        """Read one token per row (`tok_B` at positions `pos_B`) after the cached keys, append its key/value
        states to `cache` (a `StaticKV`, a `ColumnKV` or a transformers `DynamicCache`) and return the
        next-token logits `[B, vocab]`. `mask_B_K` (bool, True = attend) covers the cached keys plus the new
        one; None: all. `positions` (a bound on `pos_B`) spares the step its one wait for the device."""
        kv = cache if isinstance(cache, (StaticKV, ColumnKV)) else _DynamicKV(cache)
        hidden_B_1_H = self.decoder.embed_tokens(tok_B[:, None])
        cos, sin = self._rotary(pos_B, hidden_B_1_H, positions)
        mask = None if mask_B_K is None else mask_B_K[:, None, None, :]
        for i, layer in enumerate(self.layers):
            hidden_B_1_H = hidden_B_1_H + self._attend(layer.self_attn, _norm(layer.input_layernorm, hidden_B_1_H),
                                                       cos, sin, mask, kv, i)
            hidden_B_1_H = hidden_B_1_H + layer.mlp(_norm(layer.post_attention_layernorm, hidden_B_1_H))
        kv.advance()
        return self.head(_norm(self.decoder.norm, hidden_B_1_H))[:, 0, :]

    @staticmethod
    def _attend(attn, x_B_1_H, cos, sin, mask, kv, index: int) -> torch.Tensor:
        batch, dim = x_B_1_H.shape[0], attn.head_dim
        q = attn.q_proj(x_B_1_H).view(batch, -1, dim)  # [B, heads, D]
        k = attn.k_proj(x_B_1_H).view(batch, -1, dim)
        v = attn.v_proj(x_B_1_H).view(batch, -1, dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm of each head's query and key
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k, v = q[:, :, None, :], k[:, :, None, :], v[:, :, None, :]  # [B, heads, 1, D]
        half = dim // 2
        q = q * cos + q.roll(half, dims=-1) * sin
        k = k * cos + k.roll(half, dims=-1) * sin
        keys, values = kv.update(k, v, index)
        kv_heads = keys.shape[1]
        # grouped queries: one query token, so a key/value head's query heads stand in the query-length axis
        q = q.reshape(batch, kv_heads, -1, dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        return attn.o_proj(out.reshape(batch, 1, -1))


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for an RMS norm, fused where it is a known one."""
    if type(module).__name__ not in KNOWN_NORMS:
        return module(x)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=module.variance_epsilon)
    return module.weight * normed.to(x.dtype)
