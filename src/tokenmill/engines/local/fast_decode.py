"""The fast decode step: one token per row through a Llama-family model's own submodules.

A transformers forward does, for every decoded token, work that a one-token step does not need: its
wrappers (deprecated-argument checks, output capturing, config look-ups), the attention-mask construction,
the rotary tables recomputed from the positions, a dynamic cache that grows by concatenation. On a small
model that is most of a decode step. `FastDecoder.step` calls the same modules (embedding, norms,
projections, MLPs, head: LoRA-wrapped ones included, so adapters apply) but does the rest itself:
rotary tables read from a table computed once, the key/value states written into a preallocated buffer
(`StaticKV`), the attention run on the key/value heads (grouped queries packed, no repeat), the head applied
to the one new position only.

Same tokens and logprobs as the transformers forward (tests/unit/engines/local/test_fast_decode.py: 1e-5 in
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


def causal_lm(model):
    """The transformers causal LM under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def has_forward_hooks(model) -> bool:
    """Hooks on the forward of the model, its decoder or a decoder layer (FSDP2's gathers, a user's hook), which
    a step that calls the layers' submodules would skip."""
    lm = causal_lm(model)
    decoder = getattr(lm, "model", None)
    modules = [model, lm, decoder, *getattr(decoder, "layers", ())]
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)


def has_sliding_layers(config) -> bool:
    """Whether any attention layer of `config` is sliding-window (caches, masks and steps that assume full
    attention do not apply)."""
    types = getattr(config, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def fast_decode_blocker(model) -> str | None:
    """Why `FastDecoder` cannot run this model (None: it can)."""
    lm = causal_lm(model)
    if has_forward_hooks(model):
        return "hooks on the model's forward"
    decoder = getattr(lm, "model", None)
    if decoder is None:
        return f"{type(lm).__name__} has no Llama-style decoder (embed_tokens, layers, norm, rotary_emb)"
    reason = decoder_blocker(decoder, lm.config)
    if reason is None and getattr(lm, "get_output_embeddings", lambda: None)() is None:
        return "no output embeddings"
    return reason


def decoder_blocker(decoder, config) -> str | None:
    """Why `FastDecoder.hidden` cannot stand in for `decoder`'s forward (None: it can)."""
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(decoder, n) for n in needed):
        return f"{type(decoder).__name__} is not a Llama-style decoder (embed_tokens, layers, norm, rotary_emb)"
    if decoder._forward_hooks or decoder._forward_pre_hooks or any(
            layer._forward_hooks or layer._forward_pre_hooks for layer in decoder.layers):
        return "hooks on the decoder's forward"
    kinds = {type(layer).__name__ for layer in decoder.layers}
    if not kinds <= KNOWN_LAYERS:
        return f"decoder layers {sorted(kinds - KNOWN_LAYERS)} are not ones the fast step knows"
    if has_sliding_layers(config):
        return "sliding-window attention layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        return "dynamic rotary scaling (its frequencies depend on the sequence length)"
    return None


class StaticKV:
    """Key/value states in preallocated `[B, heads, capacity, head_dim]` buffers, one pair per layer;
    `length` columns are filled. A step writes column `length` of every layer, then `advance()`s."""

    def __init__(self, keys: list, values: list, length: int, capacity: int = 0) -> None:
        self.keys, self.values, self.length, self.capacity = keys, values, length, capacity

    @classmethod
    def from_dynamic(cls, cache, extra: int, repeat: int = 1) -> StaticKV:
        """Copy a filled transformers `DynamicCache` (or a `StaticKV`'s filled columns) into buffers `extra`
        columns wider, each row `repeat`ed (row i becomes rows i*repeat .. i*repeat + repeat - 1)."""
        if isinstance(cache, StaticKV):
            pairs = [(k[:, :, : cache.length], v[:, :, : cache.length]) for k, v in zip(cache.keys, cache.values)]
        else:
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
        keys, values = [], []
        length = pairs[0][0].shape[2]
        for pair in pairs:
            for src, out in zip(pair, (keys, values)):
                rows, heads, _, dim = src.shape
                # zeros, not garbage: a CUDA-graph step attends over every column, masked, and a masked NaN
                # still poisons the sum (0 x NaN)
                buf = src.new_zeros((rows * repeat, heads, length + extra, dim))
                buf.view(rows, repeat, heads, length + extra, dim)[:, :, :, :length] = src[:, None]
                out.append(buf)
        return cls(keys, values, length)

    @classmethod
    def empty(cls, layers: int, capacity: int) -> StaticKV:
        """Buffers of `capacity` columns, allocated at each layer's first write (its shape, dtype, device)."""
        return cls([None] * layers, [None] * layers, 0, capacity)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key.shape[2]
        if self.keys[layer] is None:
            rows, heads, _, dim = key.shape
            self.keys[layer] = key.new_zeros((rows, heads, self.capacity, dim))
            self.values[layer] = value.new_zeros((rows, heads, self.capacity, value.shape[-1]))
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
    and addresses never change, which a CUDA graph can record once and replay (`engines.local.cuda_graphs`)."""

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
        lm = causal_lm(model)
        self._setup(lm.model, lm.config, lm.get_output_embeddings())

    @classmethod
    def of_decoder(cls, decoder) -> FastDecoder:
        """`hidden` over a bare decoder (no head: `step` is not available); raises where `decoder_blocker` says."""
        reason = decoder_blocker(decoder, decoder.config)
        if reason is not None:
            raise ValueError(f"the fast forward cannot run this decoder: {reason}")
        fast = cls.__new__(cls)
        fast._setup(decoder, decoder.config, None)
        return fast

    def _setup(self, decoder, config, head) -> None:
        self.decoder, self.head = decoder, head
        self.layers = list(decoder.layers[: config.num_hidden_layers])
        self._cos = self._sin = None  # rotary tables [positions, head_dim], built on first use

    def _rotary(self, pos_B_T: torch.Tensor, like: torch.Tensor, need: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, 1, T, head_dim]` of each token's position, read from tables the rotary module built
        once (the same numbers as its per-call output: each entry is one position's product, cos and sin).
        `need`: positions the tables must cover (None: read off `pos_B_T`, which waits for the device)."""
        need = int(pos_B_T.max()) + 1 if need is None else need
        if self._cos is None or self._cos.shape[0] < need or self._cos.dtype != like.dtype:
            size = max(need, 2 * (self._cos.shape[0] if self._cos is not None else 256))
            positions = torch.arange(size, device=pos_B_T.device)[None]
            cos, sin = self.decoder.rotary_emb(like, positions)
            half = cos.shape[-1] // 2  # rotate_half(x) * sin == x.roll(half) * (sin with its first half negated)
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self._cos[pos_B_T][:, None], self._sin[pos_B_T][:, None]

    def hidden(self, ids_B_T: torch.Tensor, pos_B_T: torch.Tensor, mask: torch.Tensor | None = None, cache=None,
               positions: int | None = None) -> torch.Tensor:
        """The decoder's final-normed hidden states `[B, T, hidden]` of T tokens per row at positions `pos_B_T`,
        differentiable (the trainer's forward runs here too). `mask` (bool `[B, 1, T, keys]`, True = attend)
        covers the cached keys plus the new ones; None: the new tokens attend causally to each other and to
        every cached key. `cache` (a `StaticKV`, a `ColumnKV`, a `paged.PagedKV`, a transformers `DynamicCache`
        or None: keep nothing) gets the new key/value states. `positions`: a bound on `pos_B_T` (spares a device wait)."""
        kv = None if cache is None else cache if hasattr(cache, "advance") else _DynamicKV(cache)
        hidden_B_T_H = self.decoder.embed_tokens(ids_B_T)
        cos, sin = self._rotary(pos_B_T, hidden_B_T_H, positions)
        for i, layer in enumerate(self.layers):
            hidden_B_T_H = hidden_B_T_H + self._attend(layer.self_attn, _norm(layer.input_layernorm, hidden_B_T_H),
                                                       cos, sin, mask, kv, i)
            hidden_B_T_H = hidden_B_T_H + layer.mlp(_norm(layer.post_attention_layernorm, hidden_B_T_H))
        if kv is not None:
            kv.advance(ids_B_T.shape[1])
        return _norm(self.decoder.norm, hidden_B_T_H)

    def step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, mask_B_K: torch.Tensor | None, cache,
             positions: int | None = None) -> torch.Tensor:
        """Read one token per row (`tok_B` at positions `pos_B`) after the cached keys, append its key/value
        states to `cache` and return the next-token logits `[B, vocab]`. `mask_B_K` (bool, True = attend)
        covers the cached keys plus the new one; None: all."""
        mask = None if mask_B_K is None else mask_B_K[:, None, None, :]
        return self.head(self.hidden(tok_B[:, None], pos_B[:, None], mask, cache, positions))[:, 0, :]

    @staticmethod
    def _attend(attn, x_B_T_H, cos, sin, mask, kv, index: int) -> torch.Tensor:
        batch, width, dim = x_B_T_H.shape[0], x_B_T_H.shape[1], attn.head_dim
        q = attn.q_proj(x_B_T_H).view(batch, width, -1, dim)  # [B, T, heads, D]
        k = attn.k_proj(x_B_T_H).view(batch, width, -1, dim)
        v = attn.v_proj(x_B_T_H).view(batch, width, -1, dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMS norm of each head's query and key
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        half = dim // 2
        q = q * cos + q.roll(half, dims=-1) * sin
        k = k * cos + k.roll(half, dims=-1) * sin
        keys, values = (k, v) if kv is None else kv.update(k, v, index)
        if hasattr(kv, "attend"):  # a paged cache attends over its own blocks (`engines.local.paged`)
            return attn.o_proj(kv.attend(q, index, attn.scaling))
        return attn.o_proj(attention(q, keys, values, mask, attn.scaling))


MANUAL_ATTENTION_KEYS = 256  # one-token steps over at most this many keys on a CPU: matmul + softmax (faster)


def attention(q_B_Q_T_D: torch.Tensor, keys_B_K_S_D: torch.Tensor, values_B_K_S_D: torch.Tensor,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention output `[B, T, heads x D]` of T queries per row over S keys (K key/value heads, grouped
    queries). `mask`: bool `[B, 1, T, S]`, True = attend; None: causal where S == T, else every key.

    One query token: a key/value head's query heads stand in the query-length axis (no repeat of the keys);
    on a CPU with few keys the scores are a plain matmul and softmax, which beats SDPA's kernel at these sizes.
    """
    batch, heads, width, dim = q_B_Q_T_D.shape
    kv_heads, keys = keys_B_K_S_D.shape[1], keys_B_K_S_D.shape[2]
    if width == 1:
        q = q_B_Q_T_D.reshape(batch, kv_heads, -1, dim)
        if q.device.type == "cpu" and keys <= MANUAL_ATTENTION_KEYS:
            scores = (q @ keys_B_K_S_D.transpose(-1, -2)) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(dim=-1).to(values_B_K_S_D.dtype) @ values_B_K_S_D
        else:
            out = F.scaled_dot_product_attention(q, keys_B_K_S_D, values_B_K_S_D, attn_mask=mask, scale=scale)
        return out.reshape(batch, 1, -1)
    if mask is None and keys != width:
        raise ValueError(f"{width} new tokens after {keys - width} cached keys need a mask")
    out = F.scaled_dot_product_attention(q_B_Q_T_D, keys_B_K_S_D, values_B_K_S_D, attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=kv_heads != heads)
    return out.transpose(1, 2).reshape(batch, width, -1)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for an RMS norm, fused where it is a known one."""
    if type(module).__name__ not in KNOWN_NORMS:
        return module(x)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=module.variance_epsilon)
    return module.weight * normed.to(x.dtype)
