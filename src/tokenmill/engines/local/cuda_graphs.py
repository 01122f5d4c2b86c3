"""Decode steps replayed from a CUDA graph: one launch per token instead of one per kernel.

A one-token step of a 28-layer model is some 700 small kernels; launched one by one from Python, the GPU
waits on the launches (a few microseconds each) far longer than it computes, at batch 1 and at batch 256.
`GraphedDecode` records `FastDecoder.step` once into a CUDA graph and replays it for every token.

A graph replays fixed addresses and shapes, so the recorded step is the `ColumnKV` one: the new key/value
column is written at a position held in a device tensor, and attention runs over the whole preallocated
buffer with a mask that hides the columns not yet written. The tokens, positions, column and mask are
copied into the graph's own input tensors before each replay. A new recording is made when the buffers
change (a new `generate` call, or rows dropped from the batch) and `reset()` drops it; the engine resets at
the end of every `generate`, because under autocast the recorded step reads weight copies that live only
as long as the autocast region.

With `compile=True` the recorded step is first compiled by `torch.compile` (inductor: the norms, rotary
products, key/value writes and activations fuse into a few kernels per layer, about half the launches of
the eager step). One compile serves every batch size above one and every buffer width (dynamic shapes; a
one-row batch compiles once more, because torch specialises axes of size 1). Each compile costs about a
minute for a 28-layer model, which `compile_seconds` reports; inductor keeps its kernels in its on-disk
cache for the next run. Where compiling fails the step runs uncompiled and `compile_off` says why.

Same numbers as the eager step, up to the attention's summation order over the masked columns
(tests/unit/engines/local/test_cuda_graphs.py checks the recorded step's arithmetic on the CPU, compiled and
not; the GPU test and `benchmarks/gpu_table.py` check tokens on a GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tokenmill.engines.local.fast_decode import ColumnKV, FastDecoder, StaticKV

logger = logging.getLogger(__name__)
WARMUP_STEPS = 2  # eager steps on a side stream before recording (lazy initialisation happens outside it)


class ColumnStep:
    """`FastDecoder.step` over fixed input tensors and a `ColumnKV` view of a `StaticKV`'s buffers: the step a
    graph records (and, on any device, the same arithmetic run eagerly)."""

    def __init__(self, fast: FastDecoder, cache: StaticKV, rows: int, step: Callable | None = None) -> None:
        device = cache.keys[0].device
        self.fast = fast
        self.step = fast.step if step is None else step  # `fast.step`, or a compiled version of it
        self.capacity = cache.keys[0].shape[2]
        self.tok_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos_B = torch.zeros(rows, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.mask_B_C = torch.zeros(rows, self.capacity, dtype=torch.bool, device=device)
        self.kv = ColumnKV(cache.keys, cache.values, self.column)

    def load(self, tok_B: torch.Tensor, pos_B: torch.Tensor, mask_B_K: torch.Tensor | None, length: int) -> None:
        """Copy one step's inputs in: the new token goes to column `length`; `mask_B_K` covers columns
        0..length (None: all of them are real)."""
        self.tok_B.copy_(tok_B)
        self.pos_B.copy_(pos_B)
        self.column.fill_(length)
        width = length + 1
        if mask_B_K is None:
            self.mask_B_C[:, :width] = True
        else:
            self.mask_B_C[:, :width].copy_(mask_B_K)
        self.mask_B_C[:, width:] = False

    def run(self, eager: bool = False) -> torch.Tensor:
        step = self.fast.step if eager else self.step
        return step(self.tok_B, self.pos_B, self.mask_B_C, self.kv, positions=self.capacity)


class GraphedDecode:
    """Replays `fast`'s decode step from a CUDA graph recorded for the current `StaticKV` buffers.
    `record=False` runs the same fixed-shape step without a graph instead (any device: what the CPU tests
    check); `compile=True` compiles it first (`torch.compile`)."""

    def __init__(self, fast: FastDecoder, record: bool = True, compile: bool = False) -> None:
        self.fast = fast
        self.record = record
        self._compiled = torch.compile(fast.step, dynamic=True, fullgraph=True) if compile else None
        self.compile_off: str | None = None if compile else "turned off"
        self.compile_seconds = 0.0  # spent in the compiled step's first calls (compiling, mostly)
        self._key: tuple[int, int, int] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs: ColumnStep | None = None
        self._logits: torch.Tensor | None = None
        self.recordings = 0  # how many graphs were recorded (each costs a few eager steps)

    def step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, mask_B_K: torch.Tensor | None,
             cache: StaticKV) -> torch.Tensor:
        """The next-token logits `[B, vocab]` (the graph's output tensor: read it before the next step)."""
        key = (cache.keys[0].data_ptr(), tok_B.shape[0], cache.keys[0].shape[2])
        if key != self._key:
            self._record(cache, tok_B, pos_B, mask_B_K)
            self._key = key
        self._inputs.load(tok_B, pos_B, mask_B_K, cache.length)
        if self._graph is None:
            logits = self._inputs.run()
        else:
            self._graph.replay()
            logits = self._logits
        cache.advance()
        return logits

    def _record(self, cache: StaticKV, tok_B, pos_B, mask_B_K) -> None:
        self.reset()
        inputs = ColumnStep(self.fast, cache, tok_B.shape[0], self._compiled)
        # the warm-up steps write the column the step (or the first replay) writes again: no state is lost
        inputs.load(tok_B, pos_B, mask_B_K, cache.length)
        if not self.record:
            self._inputs = inputs
            self._warm_up(inputs)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._warm_up(inputs)
            for _ in range(WARMUP_STEPS):
                inputs.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may use the GPU
            self._logits = inputs.run()
        self._graph, self._inputs = graph, inputs
        self.recordings += 1

    def _warm_up(self, inputs: ColumnStep) -> None:
        """Run the step once eagerly (the rotary tables are built outside the compiled code), then the
        compiled one (compiling it at the first call); a compile that fails leaves the step uncompiled."""
        if self._compiled is None:
            return
        inputs.run(eager=True)
        start = time.perf_counter()
        try:
            inputs.run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: decode on, uncompiled
            self._compiled, inputs.step = None, self.fast.step
            self.compile_off = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}"
            logger.warning("decode step not compiled (%s)", self.compile_off)
        self.compile_seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Drop the recording (and the memory it holds)."""
        self._graph = self._inputs = self._logits = None
        self._key = None


def graphs_blocker(device: torch.device) -> str | None:
    """Why decode steps cannot replay from CUDA graphs on `device` (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    return None
