"""Batch-size buckets over the paged cache (padding rows on the scratch block change nothing), and
`tokenmill serve`'s continuous engine over the paged cache: the static engine's tokens, blocks shared and freed."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.local.graph_buckets import BucketedGraphs, bucket_of, bucket_sizes
from tokenmill.engines.local.paged import BlockPool, PagedKV
from tokenmill.testing.reference import assert_same_completions as assert_same
from tokenmill.types import SamplingParams

PROMPTS = ["12+34=", "7+5=", "The sum of 100 and 23 is "]


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _qwen3(vocab: int, device: str = "cpu"):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = list(range(2, vocab, 7))
    return model


def test_bucket_sizes_and_choice():
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(1) == [1] and bucket_sizes(16) == [1, 2, 4, 8, 16]
    sizes = bucket_sizes(12)
    assert [bucket_of(r, sizes) for r in (1, 2, 3, 5, 8, 9, 12, 13)] == [1, 2, 4, 8, 8, 12, 12, 13]


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_padded_bucket_step_gives_the_unpadded_logits(tokenizer, prompts, backend):
    from tokenmill.engines.local.fast_decode import FastDecoder, StaticKV
    from tokenmill.engines.local.paged_decode import prefill_states

    model = _qwen3(len(tokenizer))
    fast = FastDecoder(model)
    caches, logits = [], []
    for _ in range(2):  # the same three rows, stepped plainly and through a 4-row bucket
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        static = StaticKV.empty(2, width)
        allowed = torch.ones(3, width, width, dtype=torch.bool).tril() & mask.bool()[:, None]
        allowed |= torch.eye(width, dtype=torch.bool)
        with torch.no_grad():
            fast.hidden(ids, pos, allowed[:, None], static, positions=width)
        cache = PagedKV(BlockPool(2, 32, 4), backend)
        cache.add_rows(*prefill_states(static, mask), [0, 1, 2])
        caches.append((cache, pos[:, -1] + 1))
    tok_B = torch.tensor([5, 9, 11])
    graphs = BucketedGraphs(fast, max_rows=8, record=False, compile=False)
    with torch.no_grad():
        for step in range(6):  # across a block boundary
            (plain, pos_p), (bucketed, pos_b) = caches
            want = fast.step(tok_B, pos_p + step, None, plain)
            got = graphs.step(tok_B, pos_b + step, bucketed)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
            logits.append(got)
            assert plain.lengths == bucketed.lengths
    assert set(graphs._buckets) == {4}  # three rows padded to the 4-row bucket


def _run_continuous(model, tokenizer, prompts, params, **kw):
    with ContinuousEngine(model, tokenizer, seed=3, **kw) as engine:
        if kw.get("kv_cache") == "paged" and kw.get("cuda_graphs") is None:  # the CPU: the bucketed step eagerly
            engine._buckets = BucketedGraphs(engine._fast, engine.max_batch, record=False, compile=False)
        futures = [engine.submit(p, params, seed=i) for i, p in enumerate(prompts)]
        out = [f.result(timeout=120) for f in futures]
        return out, engine


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_continuous_engine_over_the_paged_cache_gives_the_static_tokens(tokenizer, prompts, backend):
    model = _qwen3(len(tokenizer))
    params = SamplingParams(max_tokens=14, n=4, temperature=0.9)
    static, _ = _run_continuous(model, tokenizer, prompts, params)
    paged, engine = _run_continuous(model, tokenizer, prompts, params, kv_cache="paged", kv_block_size=4,
                                    paged_attention=backend)
    assert_same(paged, static)
    assert engine._buckets._buckets  # the steps ran through the bucketed, padded step
    unbucketed, _ = _run_continuous(model, tokenizer, prompts, params, kv_cache="paged", cuda_graphs=False)
    assert_same(unbucketed, static)


def test_continuous_rows_share_prompt_blocks_and_free_them(tokenizer):
    model = _qwen3(len(tokenizer))
    model.generation_config.eos_token_id = None  # rows run to max_tokens
    prompt = list(range(3, 13))  # 10 tokens in blocks of 4: 2 full blocks, 2 tokens in the last
    seen: list[int] = []
    with ContinuousEngine(model, tokenizer, kv_cache="paged", kv_block_size=4, cuda_graphs=False) as engine:
        def on_token(row: int, token: int, logprob: float) -> None:
            if row == 0:  # from the loop thread: the blocks in use after each token
                seen.append(engine._pool.used_blocks)

        future = engine.submit(prompt, SamplingParams(max_tokens=7, n=4, temperature=1.0), seed=0,
                               on_token=on_token)
        assert [len(c.token_ids) for c in future.result(timeout=60)] == [7] * 4
        deadline = time.monotonic() + 10
        while engine.stats()["running_rows"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["kv_blocks_used"] == 0  # the finished rows gave every block back
    # after the prefill: 2 shared + 4 own; each row's 11th token (step 1) opens no block; its 13th opens one
    assert seen[0] == 2 + 4 and max(seen) == 2 + 4 + 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile_step", [False, True])
def test_recorded_bucket_graphs_match_the_eager_paged_step_on_gpu(tokenizer, prompts, compile_step):
    model = _qwen3(len(tokenizer), "cuda")
    params = SamplingParams(max_tokens=16, n=4, temperature=0.9)
    kw = {"kv_cache": "paged", "kv_block_size": 16, "paged_attention": "flex"}
    with ContinuousEngine(model, tokenizer, seed=3, compile_step=compile_step, **kw) as graphed:
        assert graphed._buckets is not None and graphed.cuda_graphs_off is None
        futures = [graphed.submit(p, params, seed=i) for i, p in enumerate(prompts)]
        got = [f.result(timeout=600) for f in futures]
        assert graphed._buckets.recordings >= 2  # rows left: a smaller bucket was recorded
        assert (graphed._buckets.compile_off is None) == compile_step, graphed._buckets.compile_off
        assert graphed._buckets.record_off is None, graphed._buckets.record_off
    eager, _ = _run_continuous(model, tokenizer, prompts, params, cuda_graphs=False, **kw)
    assert_same(got, eager, tol=1e-4)


def test_served_over_http_the_paged_engine_answers_what_the_static_one_does(tiny_model_path, tokenizer):
    import httpx

    from tokenmill.cli import build_parser
    from tokenmill.engines.server.app import create_app
    from tokenmill.serving import start_in_thread

    args = build_parser().parse_args(["serve", tiny_model_path, "--kv-cache", "paged", "--kv-block-size", "4"])
    assert (args.kv_cache, args.kv_block_size) == ("paged", 4)
    body = {"prompt": tokenizer("12+34=", add_special_tokens=False)["input_ids"], "max_tokens": 9, "n": 3,
            "temperature": 0.9, "seed": 11, "logprobs": 1}
    answers = []
    for kv_cache in ("static", "paged"):
        engine = ContinuousEngine.from_pretrained(tiny_model_path, kv_cache=kv_cache, kv_block_size=args.kv_block_size)
        server, _ = start_in_thread(create_app(engine, model_name="tiny"))
        try:
            with httpx.Client(base_url=server.url, timeout=60) as client:
                answers.append(client.post("/v1/completions", json=body).json()["choices"])
        finally:
            server.stop()
            engine.close()
        assert (engine.paged.off is None) == (kv_cache == "paged")
    static, paged = answers
    assert [c["token_ids"] for c in paged] == [c["token_ids"] for c in static]
    for a, b in zip(paged, static, strict=True):
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-5)
