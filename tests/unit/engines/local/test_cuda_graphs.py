"""The step a CUDA graph records (`engines.local.cuda_graphs`): on the CPU its arithmetic runs eagerly and must
give the transformers forward's tokens and logprobs; on a GPU the recorded graph must give the eager
step's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from tokenmill.engines import HFEngine
from tokenmill.engines.local.cuda_graphs import GraphedDecode, graphs_blocker
from tokenmill.types import SamplingParams

PROMPTS = ["12+34=", "7+5=", "The sum of 100 and 23 is "]  # different lengths: padded rows


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _qwen3(vocab: int, device: str = "cpu"):
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()


def _fixed_shape_engine(model, tokenizer, compile: bool = False, **kw) -> HFEngine:
    """An engine whose fast step runs the recorded step's arithmetic (no graph: any device), compiled or
    eagerly."""
    engine = HFEngine(model, tokenizer, **kw)
    engine._graphed = GraphedDecode(engine._fast, record=False, compile=compile)
    return engine


def _flat(groups):
    return [c for group in groups for c in group]


def _assert_same(a, b, tol=1e-5):
    a, b = _flat(a), _flat(b)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    worst = max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert worst < tol, f"largest logprob difference {worst:.2e}"
    assert sum(len(c.token_ids) for c in a) > 3 * len(a)  # several steps were decoded


@pytest.mark.parametrize("n", [1, 4])
def test_fixed_shape_step_matches_transformers(tokenizer, prompts, n):
    model = _qwen3(len(tokenizer))
    model.generation_config.eos_token_id = list(range(2, len(tokenizer), 13))  # rows stop at different steps
    params = SamplingParams(max_tokens=16, n=n, temperature=0.9)
    fixed = _fixed_shape_engine(model, tokenizer, seed=3, compact_fraction=0.1)
    plain = HFEngine(model, tokenizer, seed=3, compact_fraction=0.1, fast_decode=False)
    _assert_same(fixed.generate(prompts, params), plain.generate(prompts, params))
    assert fixed._graphed._inputs is None  # dropped at the end of the call


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_matches_transformers(tokenizer, prompts, backend):
    """The step `torch.compile` traces whole (fullgraph, dynamic shapes): one compile serves the batch as rows
    finish and leave it, with the transformers forward's tokens. In CI the traced graph runs on dynamo's eager
    backend (seconds); `-m slow` adds inductor's C++ kernels (fused, key/value writes in place: a minute of
    compiling), which the GPU test below runs as Triton kernels."""
    model = _qwen3(len(tokenizer))
    model.generation_config.eos_token_id = list(range(2, len(tokenizer), 13))
    params = SamplingParams(max_tokens=12, n=2, temperature=0.9)
    compiled = _fixed_shape_engine(model, tokenizer, compile=True, seed=3, compact_fraction=0.1)
    compiled._graphed._compiled = torch.compile(compiled._fast.step, backend=backend, dynamic=True, fullgraph=True)
    plain = HFEngine(model, tokenizer, seed=3, compact_fraction=0.1, fast_decode=False)
    _assert_same(compiled.generate(prompts, params), plain.generate(prompts, params))
    graphed = compiled._graphed
    assert graphed.compile_off is None and graphed._compiled is not None, graphed.compile_off
    assert graphed.compile_seconds > 0
    with torch._dynamo.config.patch(error_on_recompile=True):  # the batch shrank: no second compile
        _assert_same(compiled.generate(prompts, params), plain.generate(prompts, params))


def test_a_step_that_fails_to_compile_runs_uncompiled(tokenizer, prompts):
    model = _qwen3(len(tokenizer))
    params = SamplingParams(max_tokens=6, n=2, greedy=True)
    broken = _fixed_shape_engine(model, tokenizer, compile=True)

    def fails(*args, **kwargs):
        raise RuntimeError("no compiler")

    broken._graphed._compiled = fails
    plain = HFEngine(model, tokenizer, fast_decode=False)
    _assert_same(broken.generate(prompts, params), plain.generate(prompts, params))
    assert broken._graphed.compile_off == "torch.compile failed: RuntimeError: no compiler"


def test_fixed_shape_step_under_bf16_autocast(tokenizer, prompts):
    """fp32 weights, bf16 autocast (a GPU run's default): the prefill caches fp32 keys, the step makes bf16
    ones; both paths write them into the same buffers."""
    model = _qwen3(len(tokenizer))
    params = SamplingParams(max_tokens=10, n=2, greedy=True)
    fixed = _fixed_shape_engine(model, tokenizer, autocast_dtype=torch.bfloat16)
    fast = HFEngine(model, tokenizer, autocast_dtype=torch.bfloat16)
    _assert_same(fixed.generate(prompts, params), fast.generate(prompts, params), tol=2e-2)


def test_masked_columns_are_never_read(tokenizer, prompts):
    """Garbage in the buffer's unwritten columns must not change a single logprob."""
    model = _qwen3(len(tokenizer))
    params = SamplingParams(max_tokens=6, n=2, temperature=1.0)
    clean = _fixed_shape_engine(model, tokenizer, seed=4).generate(prompts, params)
    dirty = _fixed_shape_engine(model, tokenizer, seed=4)
    from tokenmill.engines.local import fast_decode

    original = fast_decode.StaticKV.from_dynamic.__func__

    def poisoned(cls, cache, extra, repeat=1):
        kv = original(cls, cache, extra, repeat)
        for buf in kv.keys + kv.values:
            assert not buf[:, :, kv.length :].any()  # zeros (a masked NaN would still reach the sum)
            buf[:, :, kv.length :] = 1e4  # huge keys/values where nothing was written yet
        return kv

    fast_decode.StaticKV.from_dynamic = classmethod(poisoned)
    try:
        _assert_same(dirty.generate(prompts, params), clean)
    finally:
        fast_decode.StaticKV.from_dynamic = classmethod(original)


def test_graphs_are_off_on_the_cpu(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    assert engine._graphed is None and engine.cuda_graphs_off == "CUDA graphs need a CUDA device, not cpu"
    assert HFEngine(tiny_model, tokenizer, cuda_graphs=False).cuda_graphs_off == "turned off"
    from tokenmill.engines.local.continuous import ContinuousEngine

    continuous = ContinuousEngine(tiny_model, tokenizer)  # its batch changes shape every step: never a graph
    try:
        assert continuous._graphed is None and "continuous batch" in continuous.cuda_graphs_off
    finally:
        continuous.close()
    assert graphs_blocker(torch.device("cpu")) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile_step", [False, True])
def test_recorded_graph_matches_the_eager_step_on_gpu(tokenizer, prompts, compile_step):
    model = _qwen3(len(tokenizer), "cuda")
    model.generation_config.eos_token_id = list(range(2, len(tokenizer), 13))
    params = SamplingParams(max_tokens=16, n=4, temperature=0.9)
    graphed = HFEngine(model, tokenizer, seed=3, compact_fraction=0.1, compile_step=compile_step)
    eager = HFEngine(model, tokenizer, seed=3, compact_fraction=0.1, cuda_graphs=False)
    assert graphed._graphed is not None
    _assert_same(graphed.generate(prompts, params), eager.generate(prompts, params), tol=1e-4)
    assert graphed._graphed.recordings >= 2  # rows left the batch: a new recording for the smaller batch
    assert (graphed._graphed.compile_off is None) == compile_step, graphed._graphed.compile_off


def test_column_writes_cast_to_the_buffer_dtype():
    from tokenmill.engines.local.fast_decode import ColumnKV

    keys, values = [torch.zeros(2, 3, 5, 4)], [torch.zeros(2, 3, 5, 4)]
    kv = ColumnKV(keys, values, torch.tensor([2]))
    new = torch.arange(24, dtype=torch.bfloat16).view(2, 3, 1, 4)
    k, v = kv.update(new, -new, 0)
    assert k.dtype == torch.float32 and k.shape == (2, 3, 5, 4)  # the whole buffer, fp32
    assert torch.equal(k[:, :, 2:3], new.float()) and torch.equal(v[:, :, 2:3], -new.float())
    assert not k[:, :, [0, 1, 3, 4]].any()
