"""The in-process engine over the paged cache, and sampling on the device: the static path's tokens, logprobs
within 1e-5 (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tokenmill.engines import HFEngine
from tokenmill.engines.local.paged import blocks_needed
from tokenmill.testing.reference import assert_same_completions as assert_same
from tokenmill.types import SamplingParams

PROMPTS = ["12+34=", "7+5=", "The sum of 100 and 23 is "]  # different lengths: padded rows in the static path


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture
def qwen3(tokenizer):
    """A 2-layer Qwen3 (q/k norms, 4 query heads on 2 key/value heads), rows stopping at different steps."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = list(range(2, len(tokenizer), 7))
    return model


CASES = [SamplingParams(max_tokens=14, n=4, temperature=0.9), SamplingParams(max_tokens=10, n=3, greedy=True),
         SamplingParams(max_tokens=12, n=2, top_k=5, top_p=0.8, temperature=1.3)]


@pytest.mark.parametrize("backend", ["gather", "flex"])
@pytest.mark.parametrize("params", CASES, ids=["sampled", "greedy", "top-k-top-p"])
def test_paged_cache_gives_the_static_paths_tokens(qwen3, tokenizer, prompts, backend, params):
    paged = HFEngine(qwen3, tokenizer, seed=5, kv_cache="paged", kv_block_size=4, paged_attention=backend,
                     compact_fraction=0.1)
    static = HFEngine(qwen3, tokenizer, seed=5, compact_fraction=0.1)
    assert paged.paged.off is None and paged.paged.backend == backend
    assert static.paged.off == "turned off (kv_cache: static)"
    assert_same(paged.generate(prompts, params), static.generate(prompts, params))
    # the n rows of each prompt shared its full blocks: the pool is what that needs, not rows x width
    lengths = [len(p) for p in prompts]
    assert paged.paged.last_pool.capacity == blocks_needed(lengths, params.n, params.max_tokens, 4)
    assert paged.paged.last_pool.capacity < len(prompts) * params.n * (max(lengths) + params.max_tokens) // 4


def test_paged_cache_with_stop_strings_prefix_cache_and_the_tiny_model(tiny_model, tokenizer, prompts):
    params = SamplingParams(max_tokens=12, n=3, temperature=0.8, stop=("9",))
    kw = {"seed": 2, "prefix_cache_tokens": 256}  # the prefill runs through transformers (a DynamicCache)
    paged, static = HFEngine(tiny_model, tokenizer, kv_cache="paged", **kw), HFEngine(tiny_model, tokenizer, **kw)
    for _ in range(2):  # the second call reuses stored prefixes
        assert_same(paged.generate(prompts, params), static.generate(prompts, params))
    assert paged.prefix_cache.hits > 0


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("params", CASES, ids=["sampled", "greedy", "top-k-top-p"])
def test_sampling_on_the_device_gives_the_host_paths_tokens(qwen3, tokenizer, prompts, chunk, params):
    device = HFEngine(qwen3, tokenizer, seed=7, kv_cache="paged", sample_on_device=True, sample_chunk=chunk)
    host = HFEngine(qwen3, tokenizer, seed=7, compact_fraction=1.0)  # rows never leave: one uniform per row
    assert device.paged.on_device_off is None
    for _ in range(2):  # and the generator is where the host path left it
        assert_same(device.generate(prompts, params), host.generate(prompts, params))
    assert device.paged.last_pool.used_blocks == 0  # every row gave its blocks back
    if chunk > 1:  # the host read the tokens a chunk at a time
        assert device.paged.copies < device.paged.steps


def test_switches_off_say_why(tiny_model, tokenizer):
    no_fast = HFEngine(tiny_model, tokenizer, fast_decode=False, kv_cache="paged", sample_on_device=True)
    assert no_fast.paged.off.startswith("no fast decode step") and no_fast.paged.on_device_off.startswith("needs")
    assert HFEngine(tiny_model, tokenizer).paged.on_device_off == "turned off"
    for bad in ({"kv_cache": "ring"}, {"paged_attention": "dense"}, {"kv_block_size": 0}):
        with pytest.raises(ValueError):
            HFEngine(tiny_model, tokenizer, **bad)


def test_the_engine_section_selects_the_paged_cache(tiny_model, tokenizer):
    from tokenmill.config.schema import EngineConfig

    assert EngineConfig().paged_options()["kv_cache"] == "static"  # existing runs decode as before
    section = EngineConfig.model_validate({"kv_cache": "paged", "kv_block_size": 8, "sample_on_device": True})
    engine = HFEngine(tiny_model, tokenizer, **section.paged_options())
    assert engine.paged.off is None and engine.paged.on_device_off is None and engine.paged.block_size == 8
    assert engine.paged.backend == "gather"  # auto, on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bucket_graphs_and_device_sampling_on_gpu(qwen3, tokenizer, prompts):
    model = qwen3.to("cuda")
    params = SamplingParams(max_tokens=16, n=4, temperature=0.9)
    kw = {"seed": 3, "kv_cache": "paged", "paged_attention": "flex", "compact_fraction": 1.0}
    graphed = HFEngine(model, tokenizer, **kw)
    eager = HFEngine(model, tokenizer, cuda_graphs=False, **kw)
    on_device = HFEngine(model, tokenizer, sample_on_device=True, **kw)
    assert graphed._buckets is not None and eager._buckets is None
    reference = eager.generate(prompts, params)
    assert_same(graphed.generate(prompts, params), reference, tol=1e-4)
    assert graphed._buckets.compile_off is None, graphed._buckets.compile_off
    assert_same(on_device.generate(prompts, params), reference, tol=1e-4)
    assert on_device.paged.copies < on_device.paged.steps
