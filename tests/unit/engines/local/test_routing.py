"""The in-process engine records a mixture-of-experts model's expert choice for every token it reads."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.routing import RoutingRecorder, moe_routers, routes_width
from tokenmill.types import SamplingParams


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    from tokenmill.testing import build_tiny_moe_model

    return build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=32, num_layers=2, num_experts=8,
                                top_k=2, expert_size=32)


@pytest.fixture
def moe(moe_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32), AutoTokenizer.from_pretrained(moe_path)


def _routes_of(model, ids: list[int]) -> list[tuple[int, ...]]:
    recorder = RoutingRecorder(model)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
        return [tuple(r) for r in recorder.take().tolist()]
    finally:
        recorder.close()


def test_routers_are_found_layer_by_layer(moe, tiny_model):
    model, _ = moe
    assert [type(r).__name__ for r in moe_routers(model)] == ["Qwen3MoeTopKRouter"] * 2
    assert routes_width(model) == 4 and moe_routers(tiny_model) == [] and routes_width(tiny_model) == 0
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        RoutingRecorder(tiny_model)


def test_generate_records_the_experts_of_every_token_read(moe):
    model, tok = moe
    engine = HFEngine(copy.deepcopy(model), tok, seed=3)
    engine.record_routing(True)
    assert engine.fast_decode_off == "recording the MoE routing"
    prompts = [[10, 11, 12, 13, 14], [20, 21]]  # left-padded together in one prefill
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0))
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            seq = prompt + list(c.token_ids)
            assert len(c.routes) == len(seq) and all(len(r) == 4 for r in c.routes)
            # the last sampled token is never read: no routing; every other token's is what a plain fp32
            # forward over the whole sequence picks (same weights, same precision)
            assert c.routes.dtype == torch.int16 and c.routes[-1].tolist() == [-1] * 4
            expected = _routes_of(model, seq)
            assert [tuple(sorted(r[:2])) + tuple(sorted(r[2:])) for r in c.routes[:-1].tolist()] == \
                   [tuple(sorted(r[:2])) + tuple(sorted(r[2:])) for r in expected[:-1]]
            assert all(0 <= e < 8 for r in c.routes[:-1] for e in r)
    # the two rows of a prompt share its prefill, so their prompt routing is identical
    assert torch.equal(out[0][0].routes[:5], out[0][1].routes[:5])
    # off again: completions carry no routes, and the hooks are gone
    engine.record_routing(False)
    assert engine.generate([[10, 11]], SamplingParams(max_tokens=2))[0][0].routes is None
    assert not any(r._forward_hooks for r in moe_routers(engine.model))


def test_a_shared_module_records_nothing_outside_generate(moe):
    model, tok = moe
    engine = HFEngine(model, tok, seed=0)
    engine.record_routing(True)
    with torch.no_grad():  # the trainer's forward on the same module
        model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    assert all(p == [] for p in engine._routing._pending)
    [[c]] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert len(c.routes) == 3 + len(c.token_ids)
