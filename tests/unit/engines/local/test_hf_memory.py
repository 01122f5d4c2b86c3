"""`HFEngine.release_memory` / `restore_memory`: what the engine keeps between calls goes, and the next call
samples exactly what it would have."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engines import HFEngine
from tokenmill.types import SamplingParams

PROMPTS = [[5 + i % 20 for i in range(40)], [9 + i % 13 for i in range(37)]]  # whole 16-token blocks to cache


def _tokens(engine, seed: int) -> list[list[int]]:
    engine.generator.manual_seed(seed)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=6, n=2, temperature=1.0))
    return [c.token_ids for group in out for c in group]


def test_release_empties_the_prefix_cache_and_the_next_call_samples_the_same(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer, prefix_cache_tokens=256)
    plain = HFEngine(tiny_model, tokenizer)
    _tokens(engine, 0)
    assert engine.prefix_cache.stats()["prefix_cache/tokens"] > 0
    assert engine.release_memory() == 0  # a CPU gives nothing back to a device
    assert engine.prefix_cache.stats()["prefix_cache/tokens"] == 0 and engine.memory_releases == 1
    engine.restore_memory()
    assert _tokens(engine, 7) == _tokens(plain, 7)


def test_every_memory_holder_names_a_release_method(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer, prefix_cache_tokens=64)
    for attr, release, restore in HFEngine.MEMORY_HOLDERS:
        assert hasattr(engine, attr), attr
        holder = getattr(engine, attr)
        if holder is not None:
            assert callable(getattr(holder, release)) and (restore is None or callable(getattr(holder, restore)))


@pytest.mark.gpu
def test_release_gives_the_key_value_buffers_back_on_a_gpu(tiny_model, tokenizer):
    model = tiny_model.to("cuda")
    engine = HFEngine(model, tokenizer, compile_step=False)
    _tokens(engine, 0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    freed = engine.release_memory()
    assert torch.cuda.memory_allocated() < held and freed > 0
    assert len(_tokens(engine, 1)) == 4
