"""The fast decode step against the transformers forward: same tokens, logprobs within 1e-5 (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen3Config

from tokenmill.engines import HFEngine
from tokenmill.engines.local import fast_decode
from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.local.fast_decode import FastDecoder, StaticKV, attention, fast_decode_blocker
from tokenmill.types import SamplingParams

PROMPTS = ["12+34=", "7+5=", "The sum of 100 and 23 is "]  # different lengths: padded rows


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _pair(model, tokenizer, prompts, params, seed=5, **kw):
    fast = HFEngine(model, tokenizer, seed=seed, **kw)
    plain = HFEngine(model, tokenizer, seed=seed, fast_decode=False, **kw)
    assert fast._fast is not None and fast.fast_decode_off is None
    assert plain._fast is None and plain.fast_decode_off == "turned off"
    return fast.generate(prompts, params), plain.generate(prompts, params)


def _assert_same(a, b):
    flat_a = [c for group in a for c in group]
    flat_b = [c for group in b for c in group]
    assert [c.token_ids for c in flat_a] == [c.token_ids for c in flat_b]
    assert [c.stop_reason for c in flat_a] == [c.stop_reason for c in flat_b]
    worst = max(abs(x - y) for ca, cb in zip(flat_a, flat_b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert worst < 1e-5, f"largest logprob difference {worst:.2e}"
    assert sum(len(c.token_ids) for c in flat_a) > len(flat_a)  # more than one step was decoded


def _wide_llama(**overrides):
    """A 2-layer Llama with 4 query heads on 2 key/value heads (grouped queries), random init."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("n", [1, 4])
def test_same_tokens_and_logprobs_as_transformers_forward(tiny_model, tokenizer, prompts, n):
    out = _pair(tiny_model, tokenizer, prompts, SamplingParams(max_tokens=10, n=n, temperature=0.8))
    _assert_same(*out)


def test_grouped_queries_untied_head_early_stops_and_stop_strings(tokenizer, prompts):
    model = _wide_llama(tie_word_embeddings=False)
    model.generation_config.eos_token_id = list(range(2, len(tokenizer), 7))  # rows stop at different steps
    params = SamplingParams(max_tokens=12, n=3, stop=("9",))
    fast, plain = _pair(model, tokenizer, prompts, params, compact_fraction=0.1)
    _assert_same(fast, plain)
    assert len({len(c.token_ids) for group in fast for c in group}) > 2  # rows left the batch mid-way


def test_qwen3_head_norms(tokenizer, prompts):
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=103, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _assert_same(*_pair(model, tokenizer, prompts, SamplingParams(max_tokens=8, n=2)))


def test_lora_adapters_apply_in_the_fast_step(tiny_model, tokenizer, prompts):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # nonzero adapters, so that they change the numbers
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    fast, plain = _pair(model, tokenizer, prompts, SamplingParams(max_tokens=8, n=2))
    _assert_same(fast, plain)
    with model.disable_adapter():
        _, base = _pair(model, tokenizer, prompts, SamplingParams(max_tokens=8, n=2))
    assert [c.logprobs for g in fast for c in g] != [c.logprobs for g in base for c in g]


def test_weight_updates_reach_the_fast_step(tiny_model, tokenizer, prompts):
    fast = HFEngine(tiny_model, tokenizer, seed=2)
    plain = HFEngine(tiny_model, tokenizer, seed=2, fast_decode=False)
    params = SamplingParams(max_tokens=6, n=2)
    fast.generate(prompts, params), plain.generate(prompts, params)
    with torch.no_grad():  # as a trainer's optimiser step: the live module's weights change in place
        for p in tiny_model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    _assert_same(fast.generate(prompts, params), plain.generate(prompts, params))


def test_continuous_engine_uses_the_fast_step(tiny_model_path, tokenizer, prompts):
    params = SamplingParams(max_tokens=8, n=2, temperature=0.9)
    results = []
    for fast in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with ContinuousEngine(model, tokenizer, seed=4, fast_decode=fast) as engine:
            assert (engine._fast is not None) == fast
            results.append([engine.submit(p, params, seed=i).result(timeout=60) for i, p in enumerate(prompts)])
    _assert_same(*results)


def test_unknown_models_fall_back_with_a_reason(tokenizer):
    from transformers import GPT2Config

    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=103, n_embd=32, n_layer=1, n_head=2))
    assert "no Llama-style decoder" in fast_decode_blocker(model)
    engine = HFEngine(model, tokenizer)
    assert engine._fast is None and "Llama-style" in engine.fast_decode_off
    [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert len(c.token_ids) == len(c.logprobs) == 3
    with pytest.raises(ValueError, match="fast decode cannot run"):
        FastDecoder(model)


def test_static_cache_writes_in_place_and_selects_rows():
    k = [torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)]

    cache = DynamicCache()
    cache.update(k[0], k[0] + 100, 0)
    kv = StaticKV.from_dynamic(cache, extra=2, repeat=2)
    assert kv.keys[0].shape == (4, 1, 5, 2) and kv.length == 3
    assert torch.equal(kv.keys[0][1, :, :3], k[0][0]) and torch.equal(kv.values[0][2, :, :3], k[0][1] + 100)
    buffer = kv.keys[0].data_ptr()
    keys, _ = kv.update(torch.full((4, 1, 1, 2), -1.0), torch.zeros(4, 1, 1, 2), 0)
    kv.advance()
    assert keys.shape == (4, 1, 4, 2) and keys.data_ptr() == buffer and kv.length == 4
    kv.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(kv.keys[0][0, :, :3], k[0][1]) and float(kv.keys[0][1, 0, 3, 0]) == -1.0


def test_hooked_models_decode_through_transformers(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    assert engine._fast is not None
    calls = []  # a hook on a decoder layer (as FSDP2's parameter gathering) added after the engine was built
    tiny_model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    params = SamplingParams(max_tokens=4, greedy=True)
    [[c]] = engine.generate(prompts[:1], params)
    assert len(c.token_ids) == 4 and len(calls) == 4  # the prompt's forward and three decode steps
    assert "hooks" in HFEngine(tiny_model, tokenizer).fast_decode_off


def test_whole_sequence_forward_matches_the_decoder_and_fills_the_cache():
    """`hidden` on T tokens per row (the trainer's forward, the engine's prefill): the decoder's hidden states
    within 1e-5, causal without a mask and with a padded 4-D mask, keys written into a lazily allocated cache."""
    model = _wide_llama()
    fast = FastDecoder(model)
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7).expand(3, 7)
    plain = model.model(input_ids=ids, use_cache=False).last_hidden_state
    cache = StaticKV.empty(layers=2, capacity=10)
    got = fast.hidden(ids, pos, None, cache)
    assert torch.allclose(got, plain, atol=1e-5, rtol=0)
    assert cache.length == 7 and cache.keys[0].shape == (3, 2, 10, 8)
    assert cache.keys[0][:, :, 7:].abs().sum() == 0  # columns not yet written are zeros
    # left padding: row 0 has two pad tokens; its real tokens match the unpadded row's states
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :2] = 0
    pos_padded = pos.clone()
    pos_padded[0] = torch.tensor([0, 0, 0, 1, 2, 3, 4])
    from tokenmill.engines.local.hf import prefill_allowed

    padded = fast.hidden(ids, pos_padded, prefill_allowed(mask)[:, None])
    alone = model.model(input_ids=ids[:1, 2:], use_cache=False).last_hidden_state
    assert torch.allclose(padded[0, 2:], alone[0], atol=1e-5, rtol=0)
    assert torch.isfinite(padded).all()  # pad queries attend to themselves: no empty softmax row


def test_small_cpu_steps_attend_by_matmul_with_sdpa_numbers(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 4, 1, 8, generator=g), torch.randn(5, 2, 9, 8, generator=g), torch.randn(5, 2, 9, 8, generator=g)
    mask = torch.rand(5, 1, 1, 9, generator=g) > 0.3
    mask[..., 0] = True
    by_matmul = attention(q, k, v, mask, 0.3)
    monkeypatch.setattr(fast_decode, "MANUAL_ATTENTION_KEYS", 0)  # the SDPA branch
    by_sdpa = attention(q, k, v, mask, 0.3)
    assert by_matmul.shape == (5, 1, 32) and torch.allclose(by_matmul, by_sdpa, atol=1e-6, rtol=0)
    # head h of the output reads key/value head h // 2 (grouped queries)
    expected = torch.softmax((q[1, 3, 0] @ k[1, 1].T * 0.3).masked_fill(~mask[1, 0, 0], float("-inf")), -1) @ v[1, 1]
    assert torch.allclose(by_matmul[1, 0, 24:], expected, atol=1e-6)
    with pytest.raises(ValueError, match="need a mask"):
        attention(torch.randn(1, 4, 2, 8), k[:1], v[:1], None, 0.3)
