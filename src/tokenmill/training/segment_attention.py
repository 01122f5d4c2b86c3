"""Attention over packed rows by segments, without a `[rows, L, L]` mask.

A packed row (`training.packing`) holds a prompt and the completions that continue it (or, for SFT, whole
sequences side by side). The dense way to keep them apart is a boolean mask of every query against every
key: L² per row, 256 MiB at L = 16K. Here each completion attends to exactly what its own unpacked row held:
its prompt's keys and its own earlier tokens. The prompts run as one causal attention over the rows'
first columns; the completions run as one attention over `[segments, heads, completion, prompt +
completion]` gathered from the rows. Memory grows with the tokens (times the prompt length for the gathered
prompt keys), not with L².

transformers calls the attention function it finds under the model's implementation name at every forward,
and hands it the keyword arguments the model was called with. `install()` puts a wrapper under "sdpa" that
runs the segmented attention when the call carries `segments=` (a `SegmentIndex`) and transformers' own
SDPA otherwise, so nothing changes for a call without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

MIN_WIDTH = 1024  # rows at least this wide attend by segments; below, the dense mask is smaller than the gathers


@dataclass(frozen=True)
class SegmentIndex:
    """Where each packed token's query and keys are, for rows of `width` columns (flat index r * width + t)."""

    width: int
    prompt_width: int  # the longest prompt: columns 0..prompt_width-1 of every row attend causally
    prompt_src: torch.Tensor  # long [P]: flat (r * prompt_width + t) outputs of the prompt attention kept ...
    prompt_dst: torch.Tensor  # long [P]: ... and where they go (r * width + t), t < the row's prompt
    q_src_S_N: torch.Tensor  # long: each segment's query positions (pad: 0)
    kv_src_S_M: torch.Tensor  # long: its keys, the row's prompt (padded to prompt_width) then its own tokens
    mask_S_N_M: torch.Tensor  # bool: query i of segment s may attend key j
    q_keep: torch.Tensor  # bool [S, N]: the real queries ...
    q_dst: torch.Tensor  # long: ... and where their outputs go

    def to(self, device: torch.device | str) -> SegmentIndex:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return SegmentIndex(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})

    @classmethod
    def build(cls, layout: Sequence[tuple[int, Sequence[tuple[int, int]]]], width: int) -> SegmentIndex:
        """From each row's (prompt length, [(start column, length) of each completion])."""
        pw = max((p for p, _ in layout), default=0)
        n_max = max((n for _, segs in layout for _, n in segs), default=1)
        prompt_src, prompt_dst, q_src, kv_src, masks, keep = [], [], [], [], [], []
        causal_N_N = torch.ones(n_max, n_max, dtype=torch.bool).tril()
        for r, (p, segs) in enumerate(layout):
            prompt_src += [r * pw + t for t in range(p)]
            prompt_dst += [r * width + t for t in range(p)]
            for start, n in segs:
                q_src.append([r * width + start + i for i in range(n)] + [0] * (n_max - n))
                kv_src.append([r * width + t for t in range(p)] + [0] * (pw - p)
                              + [r * width + start + i for i in range(n)] + [0] * (n_max - n))
                mask = torch.zeros(n_max, pw + n_max, dtype=torch.bool)
                mask[:, :p] = True
                mask[:, pw:] = causal_N_N
                mask[:, pw + n :] = False
                mask[n:] = False
                mask[n:, 0] = True  # a pad query attends to one key (no empty softmax row)
                masks.append(mask)
                keep.append([True] * n + [False] * (n_max - n))
        q_keep = torch.tensor(keep, dtype=torch.bool).reshape(-1, n_max)
        q_src_t = torch.tensor(q_src, dtype=torch.long).reshape(-1, n_max)
        return cls(width=width, prompt_width=pw, prompt_src=torch.tensor(prompt_src, dtype=torch.long),
                   prompt_dst=torch.tensor(prompt_dst, dtype=torch.long), q_src_S_N=q_src_t,
                   kv_src_S_M=torch.tensor(kv_src, dtype=torch.long).reshape(-1, pw + n_max),
                   mask_S_N_M=torch.stack(masks) if masks else torch.zeros(0, n_max, pw + n_max, dtype=torch.bool),
                   q_keep=q_keep, q_dst=q_src_t[q_keep])


def segmented_attention(query_R_H_L_D, key_R_K_L_D, value_R_K_L_D, index: SegmentIndex, *, scale=None,
                        dropout: float = 0.0) -> torch.Tensor:
    """Attention output `[R, L, H, D]` (transformers' layout) of packed rows described by `index`; columns of
    no segment (padding) get zeros."""
    rows, heads, width, dim = query_R_H_L_D.shape
    gqa = key_R_K_L_D.shape[1] != heads
    out = query_R_H_L_D.new_zeros(rows * width, heads, dim)
    pw = index.prompt_width
    if pw:
        o = F.scaled_dot_product_attention(query_R_H_L_D[:, :, :pw], key_R_K_L_D[:, :, :pw], value_R_K_L_D[:, :, :pw],
                                           is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=gqa)
        out = out.index_put((index.prompt_dst,), o.transpose(1, 2).reshape(rows * pw, heads, dim)[index.prompt_src])
    if index.q_src_S_N.shape[0]:
        q_flat = query_R_H_L_D.transpose(1, 2).reshape(rows * width, heads, dim)
        k_flat = key_R_K_L_D.transpose(1, 2).reshape(rows * width, -1, dim)
        v_flat = value_R_K_L_D.transpose(1, 2).reshape(rows * width, -1, dim)
        o = F.scaled_dot_product_attention(
            q_flat[index.q_src_S_N].transpose(1, 2), k_flat[index.kv_src_S_M].transpose(1, 2),
            v_flat[index.kv_src_S_M].transpose(1, 2), attn_mask=index.mask_S_N_M[:, None], scale=scale,
            dropout_p=dropout, enable_gqa=gqa)  # [S, H, N, D]
        out = out.index_put((index.q_dst,), o.transpose(1, 2)[index.q_keep])
    return out.view(rows, width, heads, dim)


_SDPA = None  # transformers' own "sdpa" function, which the wrapper calls for every other call


def _sdpa_or_segments(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      segments: SegmentIndex | None = None, **kwargs):
    if segments is None:
        return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = segmented_attention(query, key, value, segments, scale=scaling, dropout=dropout if module.training else 0.0)
    return out, None


def install() -> bool:
    """Put the wrapper under transformers' "sdpa" name (once); False where this transformers has no registry."""
    global _SDPA
    try:
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if current is not _sdpa_or_segments:
        _SDPA = current
        AttentionInterface.register("sdpa", _sdpa_or_segments)
    return True


def usable(model: torch.nn.Module, width: int, min_width: int = MIN_WIDTH) -> bool:
    """Whether a forward of `model` over packed rows `width` wide should attend by segments: SDPA attention,
    no sliding-window layers, rows at least `min_width` wide."""
    from tokenmill.engines.local.fast_decode import has_sliding_layers

    config = getattr(model, "config", None)
    if width < min_width or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    return not has_sliding_layers(config) and install()
