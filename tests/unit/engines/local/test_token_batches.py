"""Engine batches sized by key/value tokens (`engine.max_batch_tokens`): the in-process engine splits a call
into decode batches within the budget; the continuous engine admits requests while their claim fits."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenmill.engines import HFEngine
from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.local.hf import token_batches
from tokenmill.types import SamplingParams


def test_token_batches_by_hand():
    p = SamplingParams(max_tokens=10, n=2)
    # rows cost n x (longest prompt in the batch + 10): [5, 5] -> 2 x 2 x 15 = 60; adding 20 -> 2 x 3 x 30 = 180
    assert token_batches([5, 5, 20, 3], p, 100) == [(0, 2), (2, 3), (3, 4)]
    assert token_batches([5, 5, 20, 3], p, 180) == [(0, 3), (3, 4)]
    assert token_batches([5, 5, 20, 3], p, 0) == [(0, 4)]  # no limit
    assert token_batches([50], p, 10) == [(0, 1)]  # one prompt over the budget goes alone
    assert token_batches([], p, 10) == [(0, 0)]


def test_split_call_returns_the_same_groups(tiny_model, tokenizer):
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "12+34=", "7+5=", "100+1="]]
    params = SamplingParams(max_tokens=6, n=2, greedy=True)
    whole = HFEngine(tiny_model, tokenizer).generate(prompts, params)
    split = HFEngine(tiny_model, tokenizer, max_batch_tokens=40)
    calls = []
    original = split._decode
    split._decode = lambda batch, prm: calls.append(len(batch)) or original(batch, prm)
    out = split.generate(prompts, params)
    assert calls == [1, 1, 1, 1]  # 2 rows x (prompt + 6) each: two prompts would need more than 40
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in whole]
    with pytest.raises(ValueError, match="max_batch_tokens"):
        HFEngine(tiny_model, tokenizer, max_batch_tokens=-1)


def test_continuous_engine_keeps_the_running_claim_within_budget(tiny_model, tokenizer):
    prompts = [tokenizer("1234567890"[: 2 + i % 8], add_special_tokens=False)["input_ids"] for i in range(12)]
    params = SamplingParams(max_tokens=20, n=2)
    budget = 2 * 2 * (10 + 20)  # two of the largest requests
    with ContinuousEngine(copy.deepcopy(tiny_model), tokenizer, max_batch_tokens=budget) as engine:
        claims = []
        step = engine._decode_step

        def measured():
            claims.append(sum(len(r.request.prompt) + r.request.params.max_tokens for r in engine._rows))
            step()

        engine._decode_step = measured
        with ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda p: engine.generate([p], params), prompts))
    assert [len(o[0]) for o in outs] == [2] * 12
    assert max(claims) <= budget, f"running rows claimed {max(claims)} tokens, budget {budget}"
    assert max(claims) > budget // 2  # more than one request ran at once
