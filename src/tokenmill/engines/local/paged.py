"""A paged key/value cache: fixed-size blocks in one pool per layer, a block table and a length per row.

The static cache (`fast_decode.StaticKV`) gives every row a buffer as wide as the longest prompt plus
`max_tokens`, and a decode step attends over the whole buffer with a mask. Here a row owns only the blocks
it has written (`block_size` tokens each, allocated as it grows), attention reads only those, rows that
finish give their blocks back at once, and the rows of one prompt (a GRPO group of n samples) share that
prompt's full blocks (reference-counted; each row copies only the partly filled last block, which it
writes into). This is the vLLM layout (Kwon et al., 2023, "PagedAttention").

Two decode attentions over the blocks, same numbers (1e-5 in fp32):

- `gather`: each row's written keys are gathered into `[rows, heads, longest row, head_dim]` (the block
  table read through an index) and attended with a length mask: reads the written positions up to the
  longest live row, not the buffer's capacity. The CPU's choice (docs/performance.md has the numbers).
- `flex`: PyTorch's FlexAttention over the pool itself, the block table as the block mask's key indices and
  a mask that maps each physical position to the row's logical one (so blocks shared by rows, or belonging
  to other rows, are handled): compiled by Triton on a GPU it visits only the row's own blocks. Uncompiled
  (the CPU) it computes a score for every position of the pool, so it is there for equality tests and as
  the fixed-shape step a CUDA graph records.

    >>> pool = BlockPool(layers=2, blocks=64, block_size=16)                  # doctest: +SKIP
    >>> cache = PagedKV(pool)                                                 # doctest: +SKIP
    >>> cache.add_rows(prompt_keys, prompt_values, columns, source=[0, 0, 0]) # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from tokenmill.engines.local.fast_decode import MANUAL_ATTENTION_KEYS

Backend = Literal["gather", "flex"]
SCRATCH = 0  # block 0 is never handed out: padding rows (graph buckets) write and read it


class BlockPool:
    """`blocks` key/value blocks of `block_size` tokens per layer, stored as `[1, kv_heads, blocks x
    block_size, head_dim]` (the layout FlexAttention takes), allocated at the first write. Blocks are
    reference-counted: `allocate` hands out one with one reference, `share` adds one, `release` drops one
    and frees the block at zero. A full pool grows (doubles), which moves the buffers: `generation` counts
    the moves (a recorded CUDA graph reads the old ones)."""

    def __init__(self, layers: int, blocks: int, block_size: int = 16) -> None:
        if blocks < 2 or block_size < 1:
            raise ValueError(f"need blocks >= 2 and block_size >= 1, got {blocks}, {block_size}")
        self.block_size, self.capacity = block_size, blocks
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.refs = [0] * blocks
        self.refs[SCRATCH] = 1
        self.free = list(range(blocks - 1, 0, -1))  # popped from the end: low ids first
        self.generation = 0

    @property
    def used_blocks(self) -> int:
        """Blocks held by rows (the scratch block not counted)."""
        return self.capacity - 1 - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            self._grow(self.capacity)
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def ensure_buffers(self, layer: int, like: torch.Tensor) -> None:
        """Allocate layer `layer`'s buffers (zeros: a padding row's scratch reads must be finite) shaped after
        `like` `[kv_heads, tokens, head_dim]`."""
        if self.keys[layer] is None:
            heads, _, dim = like.shape
            shape = (1, heads, self.capacity * self.block_size, dim)
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)

    def _grow(self, extra: int) -> None:
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is not None:
                    pad = buf.new_zeros((1, buf.shape[1], extra * self.block_size, buf.shape[3]))
                    store[i] = torch.cat([buf, pad], dim=2)
        self.refs += [0] * extra
        self.free = list(range(self.capacity + extra - 1, self.capacity - 1, -1)) + self.free
        self.capacity += extra
        self.generation += 1


def blocks_needed(prompt_lens: list[int], copies: int, max_tokens: int, block_size: int) -> int:
    """Blocks that `copies` rows of each prompt need at most (shared full prompt blocks counted once), plus
    the scratch block."""
    total = 1
    for length in prompt_lens:
        total += length // block_size + copies * -(-(length % block_size + max_tokens) // block_size)
    return total


class PagedKV:
    """The rows of one decode batch over a `BlockPool`: a block table and a length per row. The step's
    interface is `StaticKV`'s (`update` per layer, `advance` after the step) plus `attend`, which
    `FastDecoder` calls instead of attending over the returned keys."""

    def __init__(self, pool: BlockPool, backend: Backend = "gather") -> None:
        if backend not in ("gather", "flex"):
            raise ValueError(f"paged attention: 'gather' or 'flex', got {backend!r}")
        self.pool, self.backend = pool, backend
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []
        self._meta: dict[str, torch.Tensor] | None = None  # this step's index tensors (built at layer 0)
        self.device: torch.device | None = None

    def __len__(self) -> int:
        return len(self.tables)

    # ------------------------------------------------------------------------------------------ rows
    def add_rows(self, keys: list[torch.Tensor], values: list[torch.Tensor], columns: list[torch.Tensor],
                 source: list[int]) -> None:
        """Append one row per entry of `source`, each holding prompt `source[i]`'s key/value states: `keys[l]`,
        `values[l]` are layer l's `[prompts, kv_heads, width, head_dim]`, `columns[p]` the (long) indices of
        prompt p's real columns. Rows of one prompt share its full blocks; each gets its own last block."""
        bs = self.pool.block_size
        self.device = keys[0].device
        slots, cols, seen = [], [], {}
        for p in source:
            length = columns[p].numel()
            full = length // bs
            if p not in seen:  # the prompt's full blocks: written once, shared by its rows
                seen[p] = [self.pool.allocate() for _ in range(full)]
                slots += [b * bs + j for b in seen[p] for j in range(bs)]
                cols.append(p * keys[0].shape[2] + columns[p][: full * bs])
            else:
                for b in seen[p]:
                    self.pool.share(b)
            table = list(seen[p])
            if length % bs:  # the row's own partly filled block
                table.append(self.pool.allocate())
                slots += [table[-1] * bs + j for j in range(length % bs)]
                cols.append(p * keys[0].shape[2] + columns[p][full * bs :])
            self.tables.append(table)
            self.lengths.append(length)
        if not slots:
            return
        slot_S = torch.tensor(slots, device=self.device)
        col_S = torch.cat(cols).to(self.device)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            flat_k = k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[3])  # [heads, prompts x width, D]
            flat_v = v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[3])
            self.pool.ensure_buffers(layer, flat_k)
            self.pool.keys[layer][0].index_copy_(1, slot_S, flat_k[:, col_S].to(self.pool.keys[layer].dtype))
            self.pool.values[layer][0].index_copy_(1, slot_S, flat_v[:, col_S].to(self.pool.values[layer].dtype))
        self._meta = None

    def batch_select_indices(self, index: torch.Tensor | list[int]) -> None:
        """Keep only the rows at `index`, in that order; the others' blocks go back to the pool."""
        keep = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        kept = set(keep)
        for r, table in enumerate(self.tables):
            if r not in kept:
                self.pool.release(table)
        self.tables = [self.tables[r] for r in keep]
        self.lengths = [self.lengths[r] for r in keep]
        self._meta = None

    def release_all(self) -> None:
        self.batch_select_indices([])

    # ------------------------------------------------------------------------------------------ the step
    def reserve(self) -> None:
        """Give every row whose last block is full a new one (the next token's slot)."""
        bs = self.pool.block_size
        for table, length in zip(self.tables, self.lengths, strict=True):
            if length == len(table) * bs:
                table.append(self.pool.allocate())

    def step_meta(self) -> dict[str, torch.Tensor]:
        """This step's index tensors: the slot each row's new token goes to, and the attention's view of
        the written positions (the new token included)."""
        inputs = self.step_inputs()
        return attention_meta(inputs["table_B_M"], inputs["length_B"], inputs["write_B"], self.pool.block_size,
                              self.pool.capacity, self.backend)

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """The block tables `[B, blocks of the longest row]` (padded with the scratch block), the lengths
        after this step and the slot of each row's new token, as device tensors (one copy from pinned memory
        that does not wait for the device)."""
        self.reserve()
        bs = self.pool.block_size
        lengths = [n + 1 for n in self.lengths]
        width = -(-max(lengths) // bs)
        rows = len(self.tables)
        packed = [b for t in self.tables for b in t[:width] + [SCRATCH] * (width - len(t[:width]))]
        packed += lengths + [t[n // bs] * bs + n % bs for t, n in zip(self.tables, self.lengths, strict=True)]
        host = torch.tensor(packed)
        if self.device is not None and self.device.type == "cuda":
            flat = host.pin_memory().to(self.device, non_blocking=True)
        else:
            flat = host.to(self.device)
        table_B_M = flat[: rows * width].view(rows, width)
        return {"table_B_M": table_B_M, "length_B": flat[rows * width : rows * (width + 1)],
                "write_B": flat[rows * (width + 1) :]}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one new token per row (`key`, `value`: `[B, kv_heads, 1, head_dim]`)."""
        if key.shape[2] != 1:
            raise ValueError("a paged cache is written one token per row per step (prefill writes with add_rows)")
        if self._meta is None:
            self._meta = self.step_meta()
        self.pool.ensure_buffers(layer, key[:, :, 0].transpose(0, 1))
        write_kv(self.pool, layer, key, value, self._meta["write_B"])
        return key, value

    def attend(self, q_B_H_1_D: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        return paged_attention(self.pool, layer, q_B_H_1_D, self._meta, scale, self.backend)

    def advance(self, columns: int = 1) -> None:
        self.lengths = [n + columns for n in self.lengths]
        self._meta = None


def write_kv(pool: BlockPool, layer: int, key: torch.Tensor, value: torch.Tensor, write_B: torch.Tensor) -> None:
    """Scatter one token per row into its slot (`write_B`: flat pool positions)."""
    keys, values = pool.keys[layer], pool.values[layer]
    keys[0].index_copy_(1, write_B, key[:, :, 0].transpose(0, 1).to(keys.dtype))
    values[0].index_copy_(1, write_B, value[:, :, 0].transpose(0, 1).to(values.dtype))


def attention_meta(table_B_M: torch.Tensor, length_B: torch.Tensor, write_B: torch.Tensor, block_size: int,
                   capacity: int, backend: Backend) -> dict[str, torch.Tensor]:
    """The tensors one decode step's attention reads, from the block tables (`[B, M]`, padded with the
    scratch block), the lengths after the step and the write slots. Device arithmetic only, so a CUDA graph
    can record it over fixed-shape inputs."""
    meta = {"write_B": write_B, "length_B": length_B, "table_B_M": table_B_M}
    rows, width = table_B_M.shape
    offsets_S = torch.arange(width * block_size, device=table_B_M.device)
    if backend == "gather":
        meta["mask_B_1_1_S"] = (offsets_S[None] < length_B[:, None])[:, None, None]
    else:  # each row's logical block of every physical block (-1: not the row's); one column more for padding
        logical_B_N = torch.full((rows, capacity + 1), -1, dtype=torch.long, device=table_B_M.device)
        in_row_B_M = torch.arange(width, device=table_B_M.device)[None] * block_size < length_B[:, None]
        target_B_M = torch.where(in_row_B_M, table_B_M, capacity)
        logical_B_N.scatter_(1, target_B_M, torch.arange(width, device=table_B_M.device).expand(rows, -1))
        meta["logical_B_N"] = logical_B_N[:, :capacity]
        meta["table_B_M"] = table_B_M
    return meta


def paged_attention(pool: BlockPool, layer: int, q_B_H_1_D: torch.Tensor, meta: dict[str, torch.Tensor],
                    scale: float, backend: Backend) -> torch.Tensor:
    """Attention output `[B, 1, heads x head_dim]` of one query per row over its written positions."""
    keys, values = pool.keys[layer], pool.values[layer]
    if backend == "gather":
        return _gathered(pool, q_B_H_1_D, keys, values, meta, scale)
    return _flex(pool, q_B_H_1_D, keys, values, meta, scale)


def _gathered(pool: BlockPool, q_B_H_1_D, keys, values, meta, scale: float) -> torch.Tensor:
    """The rows' blocks copied whole (`index_select`: contiguous copies, ~6x a per-token gather on the CPU)
    into `[kv_heads, rows, positions, head_dim]`, kept in that order (contiguous for the matmuls), each key/value
    head's query heads standing in the query axis (grouped queries, no repeat)."""
    table_B_M = meta["table_B_M"]
    rows, width = table_B_M.shape
    kv_heads, dim, bs = keys.shape[1], keys.shape[3], pool.block_size
    flat = table_B_M.reshape(-1)
    k_K_B_S_D = keys[0].view(kv_heads, -1, bs, dim).index_select(1, flat).view(kv_heads, rows, width * bs, dim)
    v_K_B_S_D = values[0].view(kv_heads, -1, bs, dim).index_select(1, flat).view(kv_heads, rows, width * bs, dim)
    heads = q_B_H_1_D.shape[1]
    q_K_B_G_D = q_B_H_1_D.to(k_K_B_S_D.dtype).view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    mask_1_B_1_S = meta["mask_B_1_1_S"].view(1, rows, 1, -1)
    if q_K_B_G_D.device.type == "cpu" and width * bs <= MANUAL_ATTENTION_KEYS:  # as the fast step does
        scores = (q_K_B_G_D @ k_K_B_S_D.transpose(-1, -2)) * scale
        out_K_B_G_D = scores.masked_fill(~mask_1_B_1_S, float("-inf")).softmax(dim=-1) @ v_K_B_S_D
    else:
        out_K_B_G_D = F.scaled_dot_product_attention(q_K_B_G_D, k_K_B_S_D, v_K_B_S_D, attn_mask=mask_1_B_1_S,
                                                     scale=scale)
    return out_K_B_G_D.transpose(0, 1).reshape(rows, 1, heads * dim)


def _flex(pool: BlockPool, q_B_H_1_D, keys, values, meta, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    bs = pool.block_size
    table_B_M, length_B, logical_B_N = meta["table_B_M"], meta["length_B"], meta["logical_B_N"]
    rows = table_B_M.shape[0]

    def written(b, h, q_idx, kv_idx):
        logical = logical_B_N[b, kv_idx // bs]
        return (logical >= 0) & (logical * bs + kv_idx % bs < length_B[b])

    # every block of a row but its last is full (the kernel skips the mask there); the last is checked
    blocks_B = -(-length_B // bs)
    full_B_1_1 = (blocks_B - 1).to(torch.int32).view(rows, 1, 1)
    full = table_B_M.new_zeros((rows, 1, 1, pool.capacity), dtype=torch.int32)  # one column per pool block
    full[:, 0, 0, : table_B_M.shape[1]] = table_B_M
    last = torch.zeros_like(full)
    last[:, 0, 0, 0] = table_B_M.gather(1, (blocks_B - 1)[:, None])[:, 0]
    mask = BlockMask.from_kv_blocks(torch.ones_like(full_B_1_1), last, full_B_1_1, full, BLOCK_SIZE=(1, bs),
                                    mask_mod=written, seq_lengths=(1, keys.shape[2]), compute_q_blocks=False)
    batch, heads, _, dim = q_B_H_1_D.shape
    with warnings.catch_warnings():  # uncompiled use (the CPU) warns once that it is the slow reference path
        warnings.simplefilter("ignore", UserWarning)
        out = flex_attention(q_B_H_1_D.to(keys.dtype), keys, values, block_mask=mask, scale=scale,
                             enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).reshape(batch, 1, heads * dim)
