"""Model FLOPs utilisation of a training step: FLOPs per token counted two ways, over the chip's peak.

Both count a matmul's forward as 2 FLOPs per multiply-add and its backward as twice the forward (6 per
parameter and token), over the parameters a token multiplies: the q / k / v / o projections, the MLPs and the
LM head (a tied head counted once; embeddings are a look-up, norms are not matmuls). They differ in attention:

- `tokenmill`: `6 x layers x sequence x heads x head_dim`: QK^T and AV over the causal half of the keys;
- `prime_rl`: `12 x layers x sequence x heads x head_dim`, all keys (torchtitan's convention, which prime-rl
  follows: "we follow the convention and do not account for sparsity in causal attention").

Recomputed work (activation checkpointing, the chunked LM head) is never counted: MFU is the model's FLOPs,
not the hardware's. Peaks are dense bf16 tensor-core FLOP/s from the vendors' data sheets.
"""

from __future__ import annotations

from typing import Any, Literal

Convention = Literal["tokenmill", "prime_rl"]

PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "GH200": 989.4e12, "A100": 312e12,
                   "A800": 312e12, "L40S": 362e12, "B200": 2.25e15, "MI300X": 1307.4e12}


def matmul_params(config: Any) -> int:
    """Parameters a token multiplies, per the decoder's config (dense, grouped-query attention)."""
    c = getattr(config, "text_config", None) or config
    h, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q and o, k and v
    return layers * (attention + 3 * h * c.intermediate_size) + c.vocab_size * h


def flops_per_token(config: Any, seq_len: int, convention: Convention = "tokenmill") -> float:
    """Training FLOPs (forward + backward) per token of a `seq_len`-token row."""
    c = getattr(config, "text_config", None) or config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = c.num_hidden_layers * seq_len * c.num_attention_heads * head_dim
    return 6 * matmul_params(c) + {"tokenmill": 6, "prime_rl": 12}[convention] * attention


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (`torch.cuda.get_device_name()`); None if unknown."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def mfu(config: Any, seq_len: int, tokens_per_s: float, peak: float) -> dict[str, float]:
    """MFU under both conventions: `{"tokenmill": ..., "prime_rl": ...}` (fractions of `peak`)."""
    return {conv: tokens_per_s * flops_per_token(config, seq_len, conv) / peak for conv in ("tokenmill", "prime_rl")}
