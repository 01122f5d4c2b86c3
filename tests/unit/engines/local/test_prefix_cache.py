"""Prefix caching in the HF engine: reusing a stored prefix's states gives the same tokens and logprobs as
re-reading the whole prompt, under SDPA and eager attention; the cache matches, evicts and clears correctly."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.prefix_cache import PrefixCache
from tokenmill.recipes import MODEL
from tokenmill.recipes.tiny import build_tiny_model
from tokenmill.types import SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pc") / "m", seed=0, **MODEL)


def _kv(n: int, value: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    k = torch.arange(n, dtype=torch.float32).view(1, n, 1) + value
    return [(k, -k)]


def test_match_is_the_longest_stored_whole_block_prefix_leaving_one_token():
    cache = PrefixCache(capacity_tokens=1000, block=4)
    a = list(range(10))  # blocks [0..3], [4..7]; the tail 8, 9 is not stored
    cache.insert(a, _kv(10))
    kv, n = cache.match(a + [50, 51])
    assert n == 8 and kv[0][0].flatten().tolist() == list(range(8))
    assert cache.match(a[:8])[1] == 4  # at most len - 1 tokens: one is left to read
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 9])[1] == 4  # diverges in the second block
    assert cache.match([1, 2, 3, 4, 5])[1] == 0
    assert cache.match([0, 1, 2])[1] == 0  # shorter than a block


def test_lru_eviction_and_clear():
    cache = PrefixCache(capacity_tokens=8, block=4)
    cache.insert([1] * 4 + [2] * 4, _kv(8))
    cache.insert([3] * 4 + [4] * 4, _kv(8))  # over capacity: the first goes
    assert cache.tokens == 8
    assert cache.match([1] * 4 + [2] * 4 + [0])[1] == 0
    assert cache.match([3] * 4 + [4] * 4 + [0])[1] == 8
    cache.clear()
    assert cache.match([3] * 4 + [4] * 4 + [0])[1] == 0 and cache.tokens == 0


def test_a_hash_collision_is_not_reused(monkeypatch):
    cache = PrefixCache(capacity_tokens=100, block=2)
    monkeypatch.setattr(cache, "_hashes", lambda tokens: [7] * (len(tokens) // 2))  # every block collides
    cache.insert([1, 2, 3, 4], _kv(4))
    assert cache.match([9, 9, 9, 9, 9])[1] == 0
    assert cache.match([1, 2, 3, 4, 5])[1] == 4


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_multi_turn_generation_is_the_same_with_and_without_the_cache(model_path, attention):
    plain = HFEngine.from_pretrained(model_path, seed=0)
    cached = HFEngine.from_pretrained(model_path, seed=0)
    cached.enable_prefix_cache(100_000, block=4)
    for engine in (plain, cached):
        engine.model.set_attn_implementation(attention)
    rng = random.Random(0)
    histories = [[rng.randrange(7, 40) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0)
    worst = 0.0
    for turn in range(5):
        a, b = plain.generate(histories, params), cached.generate(histories, params)
        for group_a, group_b in zip(a, b, strict=True):
            for x, y in zip(group_a, group_b, strict=True):
                assert x.token_ids == y.token_ids
                worst = max(worst, max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)),
                                       default=0.0))
        # the next turn: the sampled reply and an observation appended; one episode replaced by a new one
        histories = [h + list(g[0].token_ids) + [rng.randrange(7, 40) for _ in range(rng.randint(1, 9))]
                     for h, g in zip(histories, a, strict=True)]
        if turn == 2:
            histories[1] = [rng.randrange(7, 40) for _ in range(5)]
    assert worst < 1e-4
    stats = cached.prefix_cache.stats()
    assert stats["prefix_cache/hit_rate"] > 0.6 and stats["prefix_cache/reused_tokens"] > 300


def test_weight_update_clears_the_cache(model_path):
    engine = HFEngine.from_pretrained(model_path, seed=0, prefix_cache_tokens=10_000)
    engine.generate([list(range(7, 40))], SamplingParams(max_tokens=2, n=1))
    assert engine.prefix_cache.tokens > 0
    engine.update_weights(engine.model.named_parameters(), version=1)
    assert engine.prefix_cache.tokens == 0
