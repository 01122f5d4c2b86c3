"""Prefix caching: keep the key/value states of prompts the engine has read, and let a later prompt that
starts with one of them skip re-reading that part.

Multi-turn episodes are where it pays: turn t+1's prompt is turn t's prompt plus the sampled reply plus the
environment's answer, so without a cache every turn re-reads the whole history (quadratic in the number of
turns) and a batch of histories of different lengths is padded to the longest. With it, a turn reads only
what is new since the last one.

Prompts are matched in blocks of `block` tokens by chained hashes (as vLLM and SGLang do), checked against the stored tokens: the match is the
longest run of whole blocks that a stored prompt shares with the new one. Entries are evicted least recently
used past `capacity_tokens`. The states depend on the weights: `clear()` on every weight update.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys [H, T, D], values [H, T, D])


@dataclass
class _Entry:
    kv: KV
    hashes: list[int]  # the chained hash after each whole block
    tokens: tuple[int, ...]  # what the states are of (a hash match is checked against them)


class PrefixCache:
    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        if capacity_tokens < 0 or block < 1:
            raise ValueError(f"need capacity_tokens >= 0 and block >= 1, got {capacity_tokens}, {block}")
        self.capacity_tokens = capacity_tokens
        self.block = block
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.index: dict[int, tuple[int, int]] = {}  # chained block hash -> (entry id, tokens it covers)
        self.tokens = 0
        self.next_id = 0
        self.hits = self.lookups = self.reused_tokens = 0

    def _hashes(self, tokens: Sequence[int]) -> list[int]:
        out, h = [], 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, tuple(tokens[start : start + self.block])))
            out.append(h)
        return out

    def match(self, tokens: Sequence[int]) -> tuple[KV | None, int]:
        """The stored states of the longest whole-block prefix of `tokens` (at most len - 1 tokens, so that
        at least one token is left to read), and its length; (None, 0) when nothing matches."""
        self.lookups += 1
        best: tuple[int, int] | None = None
        for h in self._hashes(tokens[: len(tokens) - 1]):
            found = self.index.get(h)
            if found is None or found[0] not in self.entries:
                break
            best = found
        if best is None:
            return None, 0
        entry_id, n = best
        if self.entries[entry_id].tokens[:n] != tuple(tokens[:n]):  # a hash collision: read it all
            return None, 0
        self.entries.move_to_end(entry_id)
        self.hits += 1
        self.reused_tokens += n
        return [(k[:, :n], v[:, :n]) for k, v in self.entries[entry_id].kv], n

    def insert(self, tokens: Sequence[int], kv: KV) -> None:
        """Store the states of `tokens` (each [H, len(tokens), D]); only whole blocks can be matched later."""
        hashes = self._hashes(tokens)
        if not hashes or self.capacity_tokens == 0:
            return
        n = len(hashes) * self.block
        known = self.index.get(hashes[-1])
        if known is not None and known[0] in self.entries and known[1] == n:
            self.entries.move_to_end(known[0])  # already stored
            return
        entry_id, self.next_id = self.next_id, self.next_id + 1
        self.entries[entry_id] = _Entry([(k[:, :n].clone(), v[:, :n].clone()) for k, v in kv], hashes,
                                        tuple(tokens[:n]))
        for i, h in enumerate(hashes):
            self.index[h] = (entry_id, (i + 1) * self.block)
        self.tokens += n
        while self.tokens > self.capacity_tokens and len(self.entries) > 1:
            self._evict()

    def _evict(self) -> None:
        entry_id, entry = self.entries.popitem(last=False)
        self.tokens -= len(entry.hashes) * self.block
        for h in entry.hashes:
            if self.index.get(h, (None,))[0] == entry_id:
                del self.index[h]

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.tokens = 0

    def stats(self) -> dict[str, float]:
        return {"prefix_cache/hit_rate": self.hits / max(1, self.lookups),
                "prefix_cache/reused_tokens": self.reused_tokens, "prefix_cache/tokens": self.tokens}
