"""Decode steps over the paged cache replayed from CUDA graphs, one per batch-size bucket.

A continuous batch changes size every few steps (rows join and leave), and a CUDA graph replays fixed
shapes. So the rows are padded up to a bucket (1, 2, 4, 8, ... rows: `bucket_sizes`), and each bucket's
step is recorded once: its inputs (tokens, positions, block tables padded to the pool's width, lengths,
write slots) are tensors of fixed shape and address that each step copies into. Padding rows read and
write the pool's scratch block (block 0, never handed out), so they cost a little arithmetic and change
nothing. The attention's index tensors are computed inside the recorded step from the table and lengths
(`paged.attention_meta`), so a replay attends over each row's current blocks. A bucket is recorded again
when the pool grows (its buffers move: `BlockPool.generation`).

The engines record buckets over FlexAttention only (`paged_attention: flex`, the GPU's `auto`): its index
tensors have one column per pool block and the compiled kernel visits only a row's own blocks, while the
gather attention at a fixed width would copy the whole pool for every row.

With `record=False` (any device) the same padded fixed-shape step runs without a graph: what the CPU tests
check against the unpadded step. On a GPU the step is compiled first (`torch.compile`: FlexAttention needs
it to visit only the rows' blocks), falling back to the uncompiled step where compiling fails
(`compile_off` says why), and to the step without graphs where capturing fails (`record_off`).

    >>> graphs = BucketedGraphs(fast)                            # doctest: +SKIP
    >>> logits_B_V = graphs.step(tok_B, pos_B, paged_cache)      # doctest: +SKIP
"""

from __future__ import annotations

import logging

import torch

from tokenmill.engines.local.fast_decode import FastDecoder
from tokenmill.engines.local.paged import (
    SCRATCH,
    BlockPool,
    PagedKV,
    attention_meta,
    paged_attention,
    write_kv,
)

logger = logging.getLogger(__name__)
WARMUP_STEPS = 2


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two up to `max_rows`, and `max_rows` itself."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return sizes + [max_rows]


def bucket_of(rows: int, sizes: list[int]) -> int:
    """The smallest bucket holding `rows` (a batch beyond the largest gets a bucket of its own size)."""
    return next((s for s in sizes if s >= rows), rows)


class FixedPagedKV:
    """A `PagedKV`'s step over fixed input tensors: writes at `write_B`, attends through the index tensors
    that `attention_meta` derives (inside the step) from `table_B_M` and `length_B`."""

    def __init__(self, pool: BlockPool, backend: str, rows: int, device: torch.device) -> None:
        self.pool, self.backend = pool, backend
        self.table_B_M = torch.full((rows, pool.capacity), SCRATCH, dtype=torch.long, device=device)
        self.length_B = torch.ones(rows, dtype=torch.long, device=device)
        self.write_B = torch.full((rows,), SCRATCH * pool.block_size, dtype=torch.long, device=device)
        self._meta: dict[str, torch.Tensor] | None = None

    def load(self, cache: PagedKV) -> None:
        """Copy `cache`'s rows in (after `reserve`): the first rows real, the rest padding on the scratch block."""
        meta = cache.step_inputs()
        real, width = meta["table_B_M"].shape
        self.table_B_M[:real, :width].copy_(meta["table_B_M"])
        self.table_B_M[:real, width:] = SCRATCH
        self.table_B_M[real:] = SCRATCH
        self.length_B[:real].copy_(meta["length_B"])
        self.length_B[real:] = 1
        self.write_B[:real].copy_(meta["write_B"])
        self.write_B[real:] = SCRATCH * self.pool.block_size

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == 0:
            self._meta = attention_meta(self.table_B_M, self.length_B, self.write_B, self.pool.block_size,
                                        self.pool.capacity, self.backend)
        write_kv(self.pool, layer, key, value, self.write_B)
        return key, value

    def attend(self, q_B_H_1_D: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        return paged_attention(self.pool, layer, q_B_H_1_D, self._meta, scale, self.backend)

    def advance(self, columns: int = 1) -> None:
        """The `PagedKV` it was loaded from advances."""


class _Bucket:
    def __init__(self, fast: FastDecoder, pool: BlockPool, backend: str, rows: int, step, positions: int) -> None:
        device = pool.keys[0].device
        self.rows, self.step, self.fast, self.positions = rows, step, fast, positions
        self.tok_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.kv = FixedPagedKV(pool, backend, rows, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_B_V: torch.Tensor | None = None

    def load(self, tok_B: torch.Tensor, pos_B: torch.Tensor, cache: PagedKV) -> None:
        real = tok_B.shape[0]
        self.tok_B[:real].copy_(tok_B)
        self.tok_B[real:] = 0
        self.pos_B[:real].copy_(pos_B)
        self.pos_B[real:] = 0
        self.kv.load(cache)

    def run(self, eager: bool = False) -> torch.Tensor:
        step = self.fast.step if eager else self.step
        return step(self.tok_B, self.pos_B, None, self.kv, positions=self.positions)


class BucketedGraphs:
    """`FastDecoder.step` over a `PagedKV`, padded to a batch-size bucket and replayed from that bucket's
    CUDA graph (`record=False`: the padded step runs eagerly)."""

    def __init__(self, fast: FastDecoder, max_rows: int = 256, record: bool = True, compile: bool = True) -> None:
        self.fast, self.record = fast, record
        self.sizes = bucket_sizes(max_rows)
        self._compiled = torch.compile(fast.step) if compile else None
        self.compile_off: str | None = None if compile else "turned off"
        self.record_off: str | None = None if record else "turned off"  # why steps replay from no graph
        self._buckets: dict[int, _Bucket] = {}
        self._generation: int | None = None
        self._pool_handle = None
        self.recordings = 0
        self.positions = 0  # a bound on the positions (rotary tables), raised as rows grow

    def step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        """Next-token logits `[B, vocab]` of the cache's rows (a view of the bucket's output: read it before
        the next step)."""
        cache.reserve()  # may grow the pool: first, so the recording sees its final buffers
        if self._generation != cache.pool.generation:
            self.reset()
            self._generation = cache.pool.generation
        rows = tok_B.shape[0]
        need = max(cache.lengths) + 1
        if need > self.positions:  # the rotary tables cover every position a recorded step may read
            self.reset()
            self._generation = cache.pool.generation
            self.positions = max(2 * need, 256)
        size = bucket_of(rows, self.sizes)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = self._make(cache, size, tok_B, pos_B)
        bucket.load(tok_B, pos_B, cache)
        if bucket.graph is None:
            logits = bucket.run()
        else:
            bucket.graph.replay()
            logits = bucket.logits_B_V
        cache.advance()
        return logits[:rows]

    def _make(self, cache: PagedKV, size: int, tok_B, pos_B) -> _Bucket:
        bucket = _Bucket(self.fast, cache.pool, cache.backend, size, self._compiled or self.fast.step, self.positions)
        bucket.load(tok_B, pos_B, cache)
        bucket.run(eager=True)  # rotary tables built outside any compiled code or recording
        self._try_compiled(bucket)
        if not self.record:
            return bucket
        try:
            self._record(bucket)
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured: decode on, without graphs
            self.record = False
            self.record_off = f"CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:300]}"
            logger.warning("paged decode step not recorded (%s)", self.record_off)
            bucket.graph = None
        return bucket

    def _record(self, bucket: _Bucket) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                bucket.run()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_handle, capture_error_mode="thread_local"):
            bucket.logits_B_V = bucket.run()
        bucket.graph = graph
        self.recordings += 1

    def _try_compiled(self, bucket: _Bucket) -> None:
        if self._compiled is None:
            return
        try:
            bucket.run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: decode on, uncompiled
            self._compiled = None
            for b in (*self._buckets.values(), bucket):
                b.step = self.fast.step
            self.compile_off = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}"
            logger.warning("paged decode step not compiled (%s)", self.compile_off)

    def reset(self) -> None:
        """Drop every recording (and the memory its inputs hold)."""
        self._buckets = {}
