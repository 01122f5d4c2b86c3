"""The in-process engine's decode over a paged key/value cache, and its sampling on the device.

`engine.kv_cache: paged` puts the decode's key/value states in a `paged.BlockPool` instead of one static
buffer per call: the n rows of a prompt share its full blocks, a row's blocks go back to the pool when it
leaves the batch, and decode attention reads only the written positions. The host loop is the static one
(`HFEngine._decode`), so sampling, stops and compaction are unchanged: same tokens, logprobs within 1e-5.

`engine.sample_on_device: true` (with the paged cache) also moves sampling and the stop checks to the device:
each step samples there (temperature, top-k, top-p: the same `sample_rows`), keeps the token as the next
step's input without a copy, and marks rows that drew an end-of-sequence token; the host copies the tokens
back every `sample_chunk` steps, or earlier once a flag copied without waiting says every row has stopped.
Each step draws one uniform per row of the whole call (`torch.rand(rows)`, a row keeping its own column
whatever leaves the batch), so the tokens do not depend on when finished rows are dropped: they are the
host path's with its compaction off (`compact_fraction: 1.0`), under the same seed. Requests with stop
strings (which need the text) sample on the host.

    >>> engine = HFEngine(model, tokenizer, kv_cache="paged", sample_on_device=True)   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engines.local.fast_decode import StaticKV
from tokenmill.engines.local.paged import BlockPool, PagedKV, blocks_needed
from tokenmill.engines.local.sampling import sample_rows
from tokenmill.types import Completion, SamplingParams, StopReason

KV_CACHES = ("static", "paged")
PAGED_ATTENTIONS = ("auto", "gather", "flex")


@dataclass
class PagedOptions:
    """How an engine decodes over the paged cache. `off` / `on_device_off` say why the paged cache / sampling
    on the device is not used (None: it is)."""

    off: str | None
    block_size: int
    backend: str
    on_device_off: str | None
    chunk: int
    pools: int = 0  # pools made (one per decode batch)
    copies: int = 0  # chunks of sampled tokens copied to the host (sampling on the device)
    steps: int = 0  # tokens sampled on the device (per row)
    last_pool: BlockPool | None = None

    @classmethod
    def of(cls, engine, kv_cache: str, block_size: int, attention: str, on_device: bool, chunk: int) -> PagedOptions:
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache: one of {KV_CACHES}, got {kv_cache!r}")
        if attention not in PAGED_ATTENTIONS:
            raise ValueError(f"paged_attention: one of {PAGED_ATTENTIONS}, got {attention!r}")
        if block_size < 1 or chunk < 1:
            raise ValueError(f"kv_block_size and sample_chunk must be >= 1, got {block_size}, {chunk}")
        off = ("turned off (kv_cache: static)" if kv_cache == "static"
               else None if engine.fast_decode_off is None else f"no fast decode step ({engine.fast_decode_off})")
        on_device_off = ("turned off" if not on_device else
                         None if off is None else "needs the paged cache (kv_cache: paged)")
        backend = attention if attention != "auto" else "flex" if engine.device.type == "cuda" else "gather"
        return cls(off, block_size, backend, on_device_off, chunk)

    def pool(self, layers: int, max_batch_tokens: int) -> BlockPool:
        """A pool for a long-lived batch (the continuous engine's): `max_batch_tokens` of blocks (at least 64),
        growing when full."""
        return BlockPool(layers, max(64, -(-max_batch_tokens // self.block_size) + 1), self.block_size)

    def cache(self, prefill_cache, mask_P_L: torch.Tensor, n: int, max_tokens: int, round_up: bool = False) -> PagedKV:
        """A `PagedKV` of n rows per prompt holding the prompt's states (a `StaticKV` or a `DynamicCache`
        from the prefill; `mask_P_L` marks the real columns). `round_up`: a pool of a power of two blocks (a
        compiled step then meets few pool shapes)."""
        keys, values, columns = prefill_states(prefill_cache, mask_P_L)
        blocks = blocks_needed([c.numel() for c in columns], n, max_tokens, self.block_size)
        blocks = 1 << (blocks - 1).bit_length() if round_up else blocks
        self.last_pool = BlockPool(len(keys), blocks, self.block_size)
        self.pools += 1
        cache = PagedKV(self.last_pool, self.backend)
        cache.add_rows(keys, values, columns, [p for p in range(len(columns)) for _ in range(n)])
        return cache


def prefill_states(prefill_cache, mask_P_L: torch.Tensor) -> tuple[list, list, list[torch.Tensor]]:
    """The prompts' key and value states per layer `[P, kv_heads, width, head_dim]` (from a `StaticKV` or a
    transformers `DynamicCache`) and each prompt's real columns (`mask_P_L`: 1 = a real key)."""
    if isinstance(prefill_cache, StaticKV):
        keys = [k[:, :, : prefill_cache.length] for k in prefill_cache.keys]
        values = [v[:, :, : prefill_cache.length] for v in prefill_cache.values]
    else:
        keys = [layer.keys for layer in prefill_cache.layers]
        values = [layer.values for layer in prefill_cache.layers]
    return keys, values, [row.nonzero().squeeze(1) for row in mask_P_L.bool()]


class DeviceSampler:
    """One `SamplingParams` for every row, sampled on the device: uniforms drawn for all `rows` of the call
    each step (`torch.rand(rows)`), each live row reading its own; end-of-sequence marked in `done_B`."""

    def __init__(self, params: SamplingParams, rows: int, generator: torch.Generator, eos_ids, device) -> None:
        self.params, self.rows, self.generator = params, rows, generator
        self.eos_E = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    def sample(self, logits_B_V: torch.Tensor, row_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        uniform_B = None if p.greedy else torch.rand(self.rows, generator=self.generator,
                                                     device=logits_B_V.device)[row_B]
        return sample_rows(logits_B_V, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                           greedy=p.greedy, uniform_B=uniform_B)

    def stopped(self, tok_B: torch.Tensor) -> torch.Tensor:
        return torch.isin(tok_B, self.eos_E)


def decode_on_device(engine, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """`HFEngine._decode` with sampling and stop checks on the device and the tokens copied in chunks."""
    n = params.n
    logits_P_V, prefill, mask_P_L, pos_P = engine._prefill(prompts, extra=0)
    cache = engine.paged.cache(prefill, mask_P_L, n, params.max_tokens, round_up=engine._buckets is not None)
    total, device = len(prompts) * n, engine.device
    max_tokens = params.max_tokens
    if engine.max_positions:
        max_tokens = max(1, min(max_tokens, engine.max_positions - max(len(p) for p in prompts)))
    sampler = DeviceSampler(params, total, engine.generator, engine.eos_ids, device)
    rows = _Rows(total)
    live_B = torch.arange(total, device=device)
    logits_B_V, pos_B = logits_P_V.repeat_interleave(n, 0), pos_P.repeat_interleave(n, 0)
    done_B = torch.zeros(total, dtype=torch.bool, device=device)
    chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
    all_done = _Flag(device)
    for step in range(max_tokens):
        tok_B, logp_B = sampler.sample(logits_B_V, live_B)
        done_B = done_B | sampler.stopped(tok_B)
        chunk.append((tok_B, logp_B))
        engine.paged.steps += 1
        all_done.copy(done_B.all())
        last = step == max_tokens - 1
        if last or len(chunk) == engine.paged.chunk or all_done.ready():
            keep = rows.take(live_B.tolist(), chunk, max_tokens, engine.eos_ids)
            engine.paged.copies += 1
            chunk = []
            if last or not keep:
                break
            if len(keep) < live_B.shape[0]:  # finished rows leave; their blocks go back to the pool
                keep_K = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_K)
                live_B, tok_B, pos_B, done_B = live_B[keep_K], tok_B[keep_K], pos_B[keep_K], done_B[keep_K]
        logits_B_V = engine._step(tok_B, pos_B, None, cache)
        pos_B = pos_B + 1
    cache.release_all()
    texts = engine.tokenizer.batch_decode(rows.tokens, skip_special_tokens=True)
    return [engine._completion(rows.tokens[i], rows.logps[i], rows.reasons[i], texts[i], params)
            for i in range(total)]


class _Rows:
    """The host's record of every row: tokens, logprobs and stop reason, filled a chunk at a time."""

    def __init__(self, total: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(total)]
        self.logps: list[list[float]] = [[] for _ in range(total)]
        self.reasons: list[StopReason | None] = [None] * total

    def take(self, live: list[int], chunk, max_tokens: int, eos_ids) -> list[int]:
        """Record a chunk of steps (one copy to the host); return the positions in `live` of rows going on."""
        tok_C_B = torch.stack([t for t, _ in chunk]).tolist()
        logp_C_B = torch.stack([lp for _, lp in chunk]).tolist()
        for toks, logps in zip(tok_C_B, logp_C_B, strict=True):
            for seq, t, lp in zip(live, toks, logps, strict=True):
                if self.reasons[seq] is not None:
                    continue
                self.tokens[seq].append(t)
                self.logps[seq].append(lp)
                if t in eos_ids:
                    self.reasons[seq] = StopReason.STOP
                elif len(self.tokens[seq]) >= max_tokens:
                    self.reasons[seq] = StopReason.LENGTH
        return [r for r, seq in enumerate(live) if self.reasons[seq] is None]


class _Flag:
    """A device boolean copied to the host without waiting: `ready()` is True once a copy has landed and
    said True (on a CPU, at once)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def copy(self, flag: torch.Tensor) -> None:
        if self.pending and self.cuda and not self.event.query():
            return  # the last copy has not landed: keep waiting for it
        self.host.copy_(flag, non_blocking=self.cuda)
        if self.cuda:
            self.event.record()
        self.pending = True

    def ready(self) -> bool:
        if not self.pending or (self.cuda and not self.event.query()):
            return False
        return bool(self.host)
