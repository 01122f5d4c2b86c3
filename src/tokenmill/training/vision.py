"""Token logprobs of a vision-language policy's batch, and which of its parameters train.

A batch with images (`Batch.images_B`) is run as length-bucketed padded rows, never packed: a packed row would
need the multimodal rotary positions of several prompts laid side by side, and the vision encoder's patches
regrouped to match, for a saving that a group's shared prompt already gives in the engine (it encodes each
prompt's images once). `micro_token_stats` says so once in the log and sends such batches here.

Each micro-batch concatenates its rows' pixel values and image grids in row order (the order the model
fills its image tokens in), computes the same multimodal positions the engine decoded with
(`engines.local.vision.rope_positions`), runs the model's backbone once and its LM head on chunks of
positions (`training.logprobs.head_token_stats`), so no `[B, T, V]` logits tensor is held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from tokenmill.engines.local.vision import backbone, rope_positions, vision_tower
from tokenmill.training.batch import Batch
from tokenmill.training.logprobs import head_token_stats

log = logging.getLogger(__name__)
_told = False


def unpacked_notice() -> None:
    """Log once that vision-language batches are not packed."""
    global _told
    if not _told:
        _told = True
        log.info("vision-language batches are trained as padded rows, not packed (training.vision)")


def batch_images(batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel values of every row's images, their grids), concatenated in row order; (None, None) without any."""
    present = [x for x in batch.images_B or () if x is not None]
    if not present:
        return None, None
    return torch.cat([x.pixel_values for x in present]), torch.cat([x.image_grid_thw for x in present])


def vision_token_stats(
    model: torch.nn.Module, micro: Batch, *, temperature: float, chunk_bytes: int, entropy: bool = False,
    entropy_grad: bool = False, autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token logprobs `[B, T]`, token entropies or None) of a micro-batch of right-padded rows with images,
    aligned with the tokens (position 0 and padding get 0)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = micro.input_ids_B_T.device
    ids_B_T = micro.input_ids_B_T
    B, T = ids_B_T.shape
    real_B_T = torch.arange(T, device=device)[None, :] < micro.lengths_B.to(device)[:, None]
    pixels, grid = batch_images(micro)
    pos_3_B_T, _ = rope_positions(model, ids_B_T, grid, real_B_T.long())
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with autocast:
        hidden_B_T_H = backbone(model, ids_B_T, pixels, grid, pos_3_B_T, use_cache=False).last_hidden_state
    predicted = real_B_T.clone()
    predicted[:, 0] = False  # position t >= 1 is predicted from t - 1
    b_N, t_N = predicted.nonzero(as_tuple=True)
    lp_N, ent_N, _ = head_token_stats(
        base.lm_head, hidden_B_T_H[b_N, t_N - 1], ids_B_T[b_N, t_N], temperature=temperature, chunk_bytes=chunk_bytes,
        entropy=entropy, entropy_grad=entropy_grad, autocast_dtype=autocast_dtype,
    )
    zeros_B_T = torch.zeros((B, T), dtype=torch.float32, device=device)
    return zeros_B_T.index_put((b_N, t_N), lp_N), None if ent_N is None else zeros_B_T.index_put((b_N, t_N), ent_N)


def vision_micro_stats(
    model: torch.nn.Module, batch: Batch, *, temperature: float, token_budget: int, chunk_bytes: int,
    entropy: bool = False, entropy_grad: bool = False, autocast_dtype: torch.dtype | None = None,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """`training.local.micro_token_stats` for a batch with images: (rows, micro-batch, logprobs, entropies)."""
    unpacked_notice()
    device = next(model.parameters()).device
    start = 0
    for micro in batch.micro_batches(token_budget):
        micro = micro.to(device)
        stats = vision_token_stats(model, micro, temperature=temperature, chunk_bytes=chunk_bytes, entropy=entropy,
                                   entropy_grad=entropy_grad, autocast_dtype=autocast_dtype)
        yield torch.arange(start, start + micro.size), micro, *stats
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
