"""Shared-prompt packing: a GRPO group's prompt is run through the model once, not G times.

The G completions of a group all continue the same prompt. Instead of G padded rows `prompt + completion_i`,
one packed row holds `prompt, completion_1, ..., completion_G`, with a block attention mask (every
completion sees the prompt and its own earlier tokens, never another completion) and position ids that
restart after the prompt for each completion. Each token sees exactly what it saw in its own row, so the
logprobs and gradients are the same (up to float rounding: the sums run in another order) while the prompt
tokens are computed once. With short answers to long prompts, the usual shape of RL data, that is most of the
work; for the quickstart's 6-token prompts and ~4-token answers it removes ~half the tokens.

Only the positions that predict a completion token are sent through the log-softmax, so the output tensors
never hold logits for prompt tokens.

A batch with images packs the same way (`training.vision`): its groups are told apart by their pictures as
well as their tokens, and `PackedRows.source_b_R_L` / `source_t_R_L` say which sample token each column holds,
for its multimodal positions and its pictures.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from tokenmill.training import segment_attention
from tokenmill.training.batch import Batch, greedy_spans
from tokenmill.training.logprobs import (
    DEFAULT_CHUNK_MIB,
    head_parts,
    head_token_stats,
    hidden_states,
    teacher_states,
)


@dataclass(frozen=True)
class PackedRows:
    """Model inputs for some packed rows and where each predicted token goes back in the `Batch`."""

    input_ids_R_L: torch.Tensor
    position_ids_R_L: torch.Tensor
    segment_R_L: torch.Tensor  # long: 0 = prompt, k = its group's k-th completion (or sequence), -1 = pad
    src_row_K: torch.Tensor  # packed row whose logits predict token k
    src_pos_K: torch.Tensor  # ... and the position in that row
    target_K: torch.Tensor  # the token id being predicted
    dst_b_K: torch.Tensor  # where its logprob goes in the Batch: row b
    dst_t_K: torch.Tensor  # ... token t
    batch_rows: torch.Tensor | None = None  # which rows of the full batch the sub-batch holds (micro_packs)
    layout: tuple = ()  # per row: (prompt length, ((start column, length) of each completion, ...)); () when
    # some row holds more than one group (`plan_lines`), which only narrow rows do: they take the dense mask
    group_R_L: torch.Tensor | None = None  # long: which group of its row a token belongs to (None: one each)
    # long: the `Batch` row and token each packed column holds (-1 for padding; a shared prompt's columns name
    # its group's first row): what a vision-language batch gathers its multimodal positions and images by
    source_b_R_L: torch.Tensor | None = None
    source_t_R_L: torch.Tensor | None = None

    @cached_property
    def allowed_R_L_L(self) -> torch.Tensor:
        """bool: query position i may attend key position j (the dense mask: L² per row; built on first use)."""
        segment_R_L = self.segment_R_L
        width = segment_R_L.shape[1]
        causal_L_L = torch.ones((width, width), dtype=torch.bool).tril()
        same_R_L_L = segment_R_L[:, :, None] == segment_R_L[:, None, :]
        key_is_prompt_R_1_L = (segment_R_L == 0)[:, None, :]
        allowed = causal_L_L & (same_R_L_L | key_is_prompt_R_1_L) & (segment_R_L >= 0)[:, None, :]
        if self.group_R_L is not None:  # rows holding several groups: a token sees its own group only
            allowed &= self.group_R_L[:, :, None] == self.group_R_L[:, None, :]
        return allowed | torch.eye(width, dtype=torch.bool)  # a pad query attends to itself (no empty row)

    @cached_property
    def segment_index(self) -> segment_attention.SegmentIndex:
        """The same rule as `allowed_R_L_L`, as gather indices for attention by segments (built on first use)."""
        return segment_attention.SegmentIndex.build(self.layout, self.input_ids_R_L.shape[1])


def prompt_segments(batch: Batch) -> list[tuple[tuple[int, ...], list[int]]]:
    """Batch rows grouped by identical prompt tokens (and, in a batch with images, identical pictures: two
    prompts of the same words over other pictures are two groups), in first-seen order."""
    ids = batch.input_ids_B_T.tolist()
    pictures = image_keys(batch.images_B) if batch.images_B is not None else [None] * batch.size
    groups: dict[tuple, list[int]] = {}
    for b, (n, p) in enumerate(zip(batch.lengths_B.tolist(), batch.prompt_lens_B.tolist(), strict=True)):
        p = max(1, min(p, n - 1))  # at least one context token and one predicted token
        groups.setdefault((tuple(ids[b][:p]), pictures[b]), []).append(b)
    return [(prompt, members) for (prompt, _), members in groups.items()]


def image_keys(images_B: tuple) -> list:
    """Per row, a key equal for rows with the same pictures (`types.ImageInputs`: pixels and grids; None for a
    text-only row). A group's samples share one object, hashed once. A multi-turn episode's samples carry
    their observations' pictures too, so only episodes with the same pictures share their prompt."""
    import hashlib

    seen: dict[int, bytes] = {}
    keys = []
    for inputs in images_B:
        if inputs is None:
            keys.append(None)
            continue
        if id(inputs) not in seen:
            digest = hashlib.blake2b(digest_size=16)
            for t in (inputs.image_grid_thw, inputs.pixel_values):
                digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            seen[id(inputs)] = digest.digest()
        keys.append(seen[id(inputs)])
    return keys


def shares_prompts(batch: Batch) -> bool:
    """Whether any two sequences share their prompt (otherwise packing has nothing to save)."""
    return batch.prompt_lens_B is not None and len(prompt_segments(batch)) < batch.size


Segments = list[tuple[tuple[int, ...], list[int]]]


def sequence_segments(batch: Batch) -> Segments:
    """Every row as its own segment with no shared prompt: `plan_rows` then packs whole sequences side by side
    (block-diagonal attention, positions restarting at 0), the usual SFT packing."""
    return [((), list(range(batch.size)))]


def plan_rows(batch: Batch, token_budget: int, segments: Segments | None = None) -> Segments:
    """Packed rows as (prompt, batch rows), each within `token_budget` tokens where a row can be.
    `segments` (from `prompt_segments`) may be passed when the caller already has them."""
    lengths = batch.lengths_B.tolist()
    rows: Segments = []
    for prompt, members in segments if segments is not None else prompt_segments(batch):
        current: list[int] = []
        size = len(prompt)
        for b in members:
            extra = lengths[b] - len(prompt)
            if current and size + extra > token_budget:
                rows.append((prompt, current))
                current, size = [], len(prompt)
            current.append(b)
            size += extra
        rows.append((prompt, current))
    return rows


Line = list[tuple[tuple[int, ...], list[int]]]  # `plan_rows` rows laid side by side in one packed row


def row_width(lengths: list[int], row: tuple[tuple[int, ...], list[int]]) -> int:
    prompt, members = row
    return len(prompt) + sum(lengths[b] - len(prompt) for b in members)


def plan_lines(batch: Batch, token_budget: int, segments: Segments | None = None) -> list[tuple[int, Line]]:
    """`plan_rows`' rows laid side by side (first fit, widest first) into lines no wider than the widest row,
    as (width, rows), widest first. The packed rows of a micro-batch are padded to its widest, so narrow
    groups (short completions) next to a wide one would otherwise be mostly padding. Wider lines than the
    widest row would cost more than they save: the whole micro-batch pads to its widest line, and the dense
    mask's attention grows with the square of the width. Rows at least `segment_attention.MIN_WIDTH` wide stay
    one per line (they attend by segments, whose index knows one group per row)."""
    lengths = batch.lengths_B.tolist()
    rows = sorted(plan_rows(batch, token_budget, segments), key=lambda row: -row_width(lengths, row))
    cap = row_width(lengths, rows[0]) if rows else 0
    lines: list[list] = []  # [width, rows]
    for row in rows:
        width = row_width(lengths, row)
        fit = next((line for line in lines if line[0] + width <= cap), None) if cap < segment_attention.MIN_WIDTH else None
        if fit is None:
            lines.append([width, [row]])
        else:
            fit[0] += width
            fit[1].append(row)
    return sorted(((width, line) for width, line in lines), key=lambda item: -item[0])


def pack(batch: Batch, lines: list[Line]) -> PackedRows:
    """Build the model inputs for `lines` (from `plan_lines`: each packed row holds one or more groups)."""
    ids = batch.input_ids_B_T.tolist()
    lengths = batch.lengths_B.tolist()
    width = max(sum(row_width(lengths, row) for row in line) for line in lines)
    # per packed row: ids, positions, segment (0 = prompt, k = its group's k-th completion, -1 = pad), group
    input_ids, positions, segments, groups, source_b, source_t = [], [], [], [], [], []
    src_row, src_pos, target, dst_b, dst_t = [], [], [], [], []
    layout = []
    for r, line in enumerate(lines):
        row_ids, row_pos, row_seg, row_grp, row_b, row_t = [], [], [], [], [], []
        for g, (prompt, members) in enumerate(line):
            p, base = len(prompt), len(row_ids)
            row_ids += prompt
            row_pos += range(p)
            row_seg += [0] * p
            row_grp += [g] * p
            row_b += [members[0]] * p
            row_t += range(p)
            layout.append((p, []))
            for k, b in enumerate(members, start=1):
                q, n = len(row_ids), lengths[b] - p
                layout[-1][1].append((q, n))
                row_ids += ids[b][p : p + n]
                row_pos += range(p, p + n)
                row_seg += [k] * n
                row_grp += [g] * n
                row_b += [b] * n
                row_t += range(p, p + n)
                # token t of sequence b (t >= p) is predicted from token t-1: the prompt's last position for
                # the first completion token, the completion's own previous position after that. With no shared
                # prompt (sequence packing) the sequence's first token has nothing to be predicted from.
                predicted = range(max(p, 1), p + n)
                src_row += [r] * len(predicted)
                src_pos += [base + t - 1 if t - 1 < p else q + t - 1 - p for t in predicted]
                dst_b += [b] * len(predicted)
                dst_t += predicted
                target += ids[b][predicted.start : p + n]
        pad = width - len(row_ids)
        input_ids.append(row_ids + [0] * pad)
        positions.append(row_pos + [0] * pad)
        segments.append(row_seg + [-1] * pad)
        groups.append(row_grp + [-1] * pad)
        source_b.append(row_b + [-1] * pad)
        source_t.append(row_t + [-1] * pad)

    def as_long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    one_each = all(len(line) == 1 for line in lines)
    return PackedRows(
        as_long(input_ids), as_long(positions), as_long(segments), as_long(src_row), as_long(src_pos),
        as_long(target), as_long(dst_b), as_long(dst_t),
        layout=tuple((p, tuple(segs)) for p, segs in layout) if one_each else (),
        group_R_L=None if one_each else as_long(groups), source_b_R_L=as_long(source_b),
        source_t_R_L=as_long(source_t),
    )


def micro_packs(
    batch: Batch, token_budget: int, segments: Segments | None = None
) -> Iterator[tuple[Batch, PackedRows]]:
    """Micro-batches as (the sub-batch of their sequences, its packed rows), each packed micro-batch's padded
    size (rows x longest row) within `token_budget`; the packed rows index into the sub-batch."""
    lines = plan_lines(batch, token_budget, segments)
    for start, stop in greedy_spans([width for width, _ in lines], token_budget):
        chosen = [line for _, line in lines[start:stop]]
        members = [b for line in chosen for _, m in line for b in m]
        local = {b: i for i, b in enumerate(members)}
        sub = batch.select(members)
        packed = pack(sub, [[(p, [local[b] for b in m]) for p, m in line] for line in chosen])
        yield sub, replace(packed, batch_rows=torch.tensor(members, dtype=torch.long))


def attention_mask(allowed_R_L_L: torch.Tensor, model: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask transformers accepts as-is: bool for SDPA, additive float for eager attention."""
    mask = allowed_R_L_L[:, None, :, :]
    if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def packed_inputs(packed: PackedRows, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                  min_width: int = segment_attention.MIN_WIDTH) -> dict:
    """The model's keyword arguments for `packed`: rows at least `min_width` wide on an SDPA model attend by
    segments (`training.segment_attention`: no [rows, L, L] mask; the all-ones 2-D mask keeps transformers
    from building one), narrower rows or other attention implementations take the dense mask."""
    inputs = {"input_ids": packed.input_ids_R_L.to(device), "position_ids": packed.position_ids_R_L.to(device)}
    width = packed.input_ids_R_L.shape[1]
    if packed.layout and segment_attention.usable(model, width, min_width):
        mask = torch.ones(packed.input_ids_R_L.shape, dtype=torch.long, device=device)
        return inputs | {"attention_mask": mask, "segments": packed.segment_index.to(device)}
    return inputs | {"attention_mask": attention_mask(packed.allowed_R_L_L, model, dtype).to(device)}


def packed_token_stats(
    model: torch.nn.Module,
    packed: PackedRows,
    out_shape: tuple[int, int],
    *,
    temperature: float,
    entropy: bool,
    entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_MIB << 20,
    teacher: torch.nn.Module | None = None,
    min_width: int = segment_attention.MIN_WIDTH,
) -> tuple[torch.Tensor, ...]:
    """Logprobs (and entropies) of every completion token, scattered into a `[B, T]` tensor (0 elsewhere).
    The LM head runs on chunks of `chunk_bytes` of fp32 logits where `head_parts` allows (0: full logits).
    With a `teacher` module, a third tensor: the reverse KL to it (`logprobs.reverse_kl`), packed the same way."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    inputs = packed_inputs(packed, model, autocast_dtype or dtype, device, min_width)
    src = (packed.src_row_K.to(device), packed.src_pos_K.to(device))
    parts = head_parts(model) if chunk_bytes > 0 else None
    taught = None
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        if parts is None:  # full logits; only the predicting positions go through the log-softmax
            picked_K_H, head = model(**inputs, use_cache=False).logits[src], torch.nn.Identity()
        else:
            picked_K_H, head = hidden_states(parts[0], **inputs)[src], parts[1]
        if teacher is not None:
            t_dtype = next(teacher.parameters()).dtype
            t_inputs = packed_inputs(packed, teacher, autocast_dtype or t_dtype, device, min_width)
            states, t_head = teacher_states(teacher, parts is not None, **t_inputs)
            taught = (t_head, states[src])
    logprob_K, ent_K, kl_K = head_token_stats(
        head, picked_K_H, packed.target_K.to(device), temperature=temperature,
        chunk_bytes=chunk_bytes if parts is not None else 0, entropy=entropy, entropy_grad=entropy_grad,
        autocast_dtype=autocast_dtype, teacher=taught,
    )
    dst = (packed.dst_b_K.to(device), packed.dst_t_K.to(device))
    zeros_B_T = torch.zeros(out_shape, dtype=torch.float32, device=device)
    out = (zeros_B_T.index_put(dst, logprob_K), None if ent_K is None else zeros_B_T.index_put(dst, ent_K))
    return out if kl_K is None else (*out, zeros_B_T.index_put(dst, kl_K))
