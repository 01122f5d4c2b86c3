"""Token logprobs of a vision-language policy's batch, and which of its parameters train.

A batch with images (`Batch.images_B`) is packed the way a text batch is (`training.packing`): a group's
shared prompt, its pictures included, once per packed row with its completions after it, narrow groups laid
side by side in one row, or whole sequences side by side (`pack_sequences`); attention stays within each
group and sample (the packed rows' block mask, or attention by segments on wide rows). What packing needs
beyond text:

- **positions**: the model's multimodal rotary positions (three per token, image tokens on their grid,
  `engines.local.vision.rope_positions`) are computed for every sample as its own row, exactly as the engine
  decoded it, and each packed column takes the positions of the sample token it holds: every sample keeps
  its own positions side by side with the others';
- **pictures**: the vision encoder fills the image tokens of a forward in order, row by row, so the pixel
  values and grids are concatenated in the order the image tokens appear in the packed rows (a shared
  prompt's pictures once: the encoder runs once per group, as the engine's does);
- **the token budget**: image tokens are tokens of the rows (the processor repeats the placeholder once per
  merged patch), so `training.micro_batch_tokens` counts them like any other.

Per-token logprobs and gradients equal the padded rows' (`vision_token_stats`, fp32, 1e-5): with
`training.share_prompts: false` (and no `pack_sequences`), or where a sampled completion would start inside
an image slot (an image token right after the prompt's vision-start token, which packing could not keep
apart), a micro-batch runs as length-bucketed padded rows instead. The LM head runs on chunks of positions
(`training.logprobs.head_token_stats`), so no `[B, T, V]` logits tensor is held.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.engines.local.vision import backbone, image_slots, rope_positions, vision_tower
from tokenmill.training import segment_attention
from tokenmill.training.batch import Batch
from tokenmill.training.local import packing_segments
from tokenmill.training.logprobs import head_token_stats
from tokenmill.training.packing import PackedRows, micro_packs, packed_inputs
from tokenmill.training.sharded import root_forward


def batch_images(batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel values of every row's images, their grids), concatenated in row order; (None, None) without any."""
    present = [x for x in batch.images_B or () if x is not None]
    if not present:
        return None, None
    return torch.cat([x.pixel_values for x in present]), torch.cat([x.image_grid_thw for x in present])


def _real(micro: Batch) -> torch.Tensor:
    T = micro.input_ids_B_T.shape[1]
    return torch.arange(T, device=micro.input_ids_B_T.device)[None, :] < micro.lengths_B[:, None]


def _head_stats(model, hidden_R_L_H, src, target_K, dst, out_shape, **kwargs) -> tuple[torch.Tensor, ...]:
    """Logprobs (and entropies) of `target_K` from the hidden states at `src`, scattered to `dst` in `[B, T]`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lp_K, ent_K, _ = head_token_stats(base.lm_head, hidden_R_L_H[src], target_K, **kwargs)
    zeros_B_T = torch.zeros(out_shape, dtype=torch.float32, device=target_K.device)
    return zeros_B_T.index_put(dst, lp_K), None if ent_K is None else zeros_B_T.index_put(dst, ent_K)


def vision_token_stats(
    model: torch.nn.Module, micro: Batch, *, temperature: float, chunk_bytes: int, entropy: bool = False,
    entropy_grad: bool = False, autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token logprobs `[B, T]`, token entropies or None) of a micro-batch of right-padded rows with images,
    aligned with the tokens (position 0 and padding get 0)."""
    device = micro.input_ids_B_T.device
    ids_B_T = micro.input_ids_B_T
    real_B_T = _real(micro)
    pixels, grid = batch_images(micro)
    pos_3_B_T, _ = rope_positions(model, ids_B_T, grid, real_B_T.long())
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with autocast:
        hidden_B_T_H = root_forward(model, backbone, model, ids_B_T, pixels, grid, pos_3_B_T,
                                    use_cache=False).last_hidden_state
    predicted = real_B_T.clone()
    predicted[:, 0] = False  # position t >= 1 is predicted from t - 1
    b_N, t_N = predicted.nonzero(as_tuple=True)
    return _head_stats(model, hidden_B_T_H, (b_N, t_N - 1), ids_B_T[b_N, t_N], (b_N, t_N), tuple(ids_B_T.shape),
                       temperature=temperature, chunk_bytes=chunk_bytes, entropy=entropy, entropy_grad=entropy_grad,
                       autocast_dtype=autocast_dtype)


def packed_pictures(model: torch.nn.Module, micro: Batch, packed: PackedRows):
    """(multimodal positions `[3, R, L]`, pixel values, image grids) of `packed`'s columns: each column's
    sample token's positions, and the pictures in the order their image tokens appear in the packed rows
    (row by row, left to right); None where a packed row's image slots would differ from its samples'."""
    ids_B_T = micro.input_ids_B_T
    device = ids_B_T.device
    real_B_T = _real(micro)
    _, grid = batch_images(micro)
    pos_3_B_T, _ = rope_positions(model, ids_B_T, grid, real_B_T.long())
    b_R_L, t_R_L = packed.source_b_R_L.to(device), packed.source_t_R_L.to(device)
    real_R_L = b_R_L >= 0
    b_R_L, t_R_L = b_R_L.clamp(min=0), t_R_L.clamp(min=0)
    pos_3_R_L = pos_3_B_T[:, b_R_L, t_R_L] * real_R_L
    slots_B_T = image_slots(model, ids_B_T) & real_B_T
    if not torch.equal(image_slots(model, packed.input_ids_R_L.to(device)), slots_B_T[b_R_L, t_R_L] & real_R_L):
        return None
    starts_B_T = slots_B_T & ~torch.cat([torch.zeros_like(slots_B_T[:, :1]), slots_B_T[:, :-1]], 1)  # first tokens
    picture_B_T = starts_B_T.long().cumsum(1) - 1  # which of its row's pictures a token starts
    r_N, c_N = (starts_B_T[b_R_L, t_R_L] & real_R_L).nonzero(as_tuple=True)  # row-major: the order they fill
    if r_N.numel() == 0:
        return pos_3_R_L, None, None
    pixels, grids, offsets = [], [], {}
    for b, j in zip(b_R_L[r_N, c_N].tolist(), picture_B_T[b_R_L[r_N, c_N], t_R_L[r_N, c_N]].tolist(), strict=True):
        inputs = micro.images_B[b]
        if b not in offsets:
            offsets[b] = [0, *inputs.image_grid_thw.prod(-1).cumsum(0).tolist()]
        pixels.append(inputs.pixel_values[offsets[b][j] : offsets[b][j + 1]])
        grids.append(inputs.image_grid_thw[j : j + 1])
    return pos_3_R_L, torch.cat(pixels), torch.cat(grids)


def packed_hidden_states(model: torch.nn.Module, micro: Batch, packed: PackedRows,
                         autocast_dtype: torch.dtype | None = None,
                         min_width: int = segment_attention.MIN_WIDTH) -> torch.Tensor | None:
    """The backbone's last hidden states `[R, L, H]` of `micro` run as its packed rows `packed`, each column
    with its sample token's positions and pictures (`packed_pictures`), attention kept within each group and
    sample (`training.packing.packed_inputs`); None where the micro-batch cannot be packed. What the policy's
    head (`packed_vision_stats`) and PPO's critic's (`training.vision_roles.packed_image_values`) read."""
    pictures = packed_pictures(model, micro, packed)
    if pictures is None:
        return None
    pos_3_R_L, pixels, grid = pictures
    device = micro.input_ids_B_T.device
    dtype = next(model.parameters()).dtype
    attention = packed_inputs(packed, model, autocast_dtype or dtype, device, min_width)
    attention = {k: v for k, v in attention.items() if k not in ("input_ids", "position_ids")}
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return root_forward(model, backbone, model, packed.input_ids_R_L.to(device), pixels, grid, pos_3_R_L,
                            use_cache=False, **attention).last_hidden_state


def packed_vision_stats(
    model: torch.nn.Module, micro: Batch, packed: PackedRows, *, temperature: float, chunk_bytes: int,
    entropy: bool = False, entropy_grad: bool = False, autocast_dtype: torch.dtype | None = None,
    min_width: int = segment_attention.MIN_WIDTH,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`vision_token_stats` of `micro` run as its packed rows `packed` (`training.packing.micro_packs`): values
    at the completion tokens (every token but each sequence's first when whole sequences are packed), 0
    elsewhere; None where the micro-batch cannot be packed (`packed_pictures`). Rows at least `min_width` wide
    attend by segments (`training.packing.packed_inputs`)."""
    hidden_R_L_H = packed_hidden_states(model, micro, packed, autocast_dtype, min_width)
    if hidden_R_L_H is None:
        return None
    device = micro.input_ids_B_T.device
    return _head_stats(model, hidden_R_L_H, (packed.src_row_K.to(device), packed.src_pos_K.to(device)),
                       packed.target_K.to(device), (packed.dst_b_K.to(device), packed.dst_t_K.to(device)),
                       tuple(micro.input_ids_B_T.shape), temperature=temperature, chunk_bytes=chunk_bytes,
                       entropy=entropy, entropy_grad=entropy_grad, autocast_dtype=autocast_dtype)


def vision_micro_stats(
    model: torch.nn.Module, batch: Batch, *, temperature: float, token_budget: int, chunk_bytes: int,
    share_prompts: bool = True, pack_sequences: bool = False, entropy: bool = False, entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """`training.local.micro_token_stats` for a batch with images: (rows, micro-batch, logprobs, entropies).
    Packed as a text batch would be (`training.local.packing_segments`), else length-bucketed padded rows."""
    device = next(model.parameters()).device
    kwargs = {"temperature": temperature, "chunk_bytes": chunk_bytes, "entropy": entropy,
              "entropy_grad": entropy_grad, "autocast_dtype": autocast_dtype}
    segments = packing_segments(batch, share_prompts=share_prompts, pack_sequences=pack_sequences)
    if segments is not None:
        for micro, packed in micro_packs(batch, token_budget, segments):
            micro = micro.to(device)
            stats = packed_vision_stats(model, micro, packed, **kwargs)
            yield packed.batch_rows, micro, *(stats or vision_token_stats(model, micro, **kwargs))
        return
    start = 0
    for micro in batch.micro_batches(token_budget):
        micro = micro.to(device)
        yield torch.arange(start, start + micro.size), micro, *vision_token_stats(model, micro, **kwargs)
        start += micro.size


def freeze_vision_tower(model: torch.nn.Module, frozen: bool = True) -> int:
    """Freeze (or unfreeze) the vision encoder and its merger; return how many parameters that covers."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    for p in tower.parameters():
        p.requires_grad_(not frozen)
    return sum(p.numel() for p in tower.parameters())


LANGUAGE_LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def image_sft_samples(processor, rows, prompt_column: str = "prompt", completion_column: str = "completion",
                      image_column: str = "images", policy=None) -> list:
    """(prompt with images, string completion) rows as SFT samples whose loss covers the completion and its
    end-of-sequence token, each carrying its prompt's `ImageInputs` (for `training.sft.run_sft(samples=...)`)."""
    from tokenmill.data.images import ImagePolicy, row_images
    from tokenmill.types import Sample, StopReason

    tok, out = processor.tokenizer, []
    for i in range(len(rows)):
        row = rows[i]
        messages, images, sources = row_images(row, prompt_column, image_column, policy or ImagePolicy(), f"row {i}")
        ids, inputs = processor.encode(messages, images, sources)
        target = list(tok(row[completion_column], add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        out.append(Sample(tokens=tuple(ids + target), loss_mask=(0,) * len(ids) + (1,) * len(target),
                          logprobs=(0.0,) * (len(ids) + len(target)), prompt_len=len(ids), prompt=row[prompt_column],
                          completion=row[completion_column], stop_reason=StopReason.STOP, images=inputs))
    return out
