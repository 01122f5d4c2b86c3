"""`tokenmill serve --enable-return-routed-experts`: the continuous engine records a mixture-of-experts model's
routing and answers it per choice (`routed_experts`, vLLM's form) to requests that ask; the remote engine reads
it into `Completion.routes`, equal to the in-process engine's, and router replay r3 over a loopback server
drops the engine/trainer mismatch exactly as it does in process."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from tokenmill.engines.local.continuous import ContinuousEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.routing import decode_routed_experts, encode_routed_experts
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.engines.server.app import create_app
from tokenmill.health.mismatch import mismatch_stats
from tokenmill.serving import start_in_thread
from tokenmill.training import LocalBackend, collate
from tokenmill.types import Sample, SamplingParams, StopReason

PROMPTS = [[5 + i, 6 + i, 7, 8 + i, 9] for i in range(6)] + [[20, 21]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.testing import build_tiny_moe_model

    path = build_tiny_moe_model(tmp_path_factory.mktemp("moe") / "m", hidden_size=64, num_layers=2, num_experts=8,
                                top_k=2, expert_size=64)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _served(model, tok, *, record: bool = True, autocast=None):
    engine = ContinuousEngine(copy.deepcopy(model), tok, seed=0, autocast_dtype=autocast)
    if record:
        engine.record_routing(True)
    server, _ = start_in_thread(create_app(engine, model_name="moe"))
    return server, engine


def _in_process(model, tok, params, autocast=None):
    engine = HFEngine(copy.deepcopy(model), tok, seed=0, autocast_dtype=autocast)
    engine.record_routing(True)
    return engine.generate(PROMPTS, params)


def test_the_wire_form_is_vllms_and_round_trips():
    routes_T_R = torch.tensor([[0, 7, 3, 1], [2, 5, 6, 4], [-1, -1, -1, -1]], dtype=torch.int16)
    import base64
    import io

    import numpy as np

    array = np.load(io.BytesIO(base64.b64decode(encode_routed_experts(routes_T_R, layers=2))))
    # vLLM's shape and dtype: [tokens read, layers, top_k] uint8; the last sampled token was never read
    assert array.dtype == np.uint8 and array.shape == (2, 2, 2) and array.tolist() == [[[0, 7], [3, 1]],
                                                                                       [[2, 5], [6, 4]]]
    assert torch.equal(decode_routed_experts(encode_routed_experts(routes_T_R, 2), 3), routes_T_R)


def test_served_routes_equal_the_in_process_engines(moe):
    model, tok = moe
    params = SamplingParams(max_tokens=8, n=2, greedy=True)
    expected = _in_process(model, tok, params)
    server, engine = _served(model, tok)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            plain = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}).json()
            assert "routed_experts" not in plain["choices"][0]  # only for a request that asks
            wire = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "n": 2,
                                                        "temperature": 0, "return_routed_experts": True}).json()
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 3, "return_routed_experts": True}).json()
            streamed = client.post("/v1/completions", json={"prompt": PROMPTS[0], "stream": True,
                                                            "return_routed_experts": True})
        remote = RemoteEngine([server.url], pad_id=tok.pad_token_id, routed_experts="ask", prompts_per_request=0)
        got = remote.generate(PROMPTS, params)
        remote.close()
    finally:
        server.stop()
        engine.close()
    for want_group, got_group in zip(expected, got, strict=True):
        for want, c in zip(want_group, got_group, strict=True):
            assert c.token_ids == want.token_ids and c.routes.dtype == torch.int16
            assert torch.equal(c.routes, want.routes)  # [prompt + completion, layers x top_k], the last one -1
    first = wire["choices"][0]
    assert torch.equal(decode_routed_experts(first["routed_experts"], len(PROMPTS[0]) + len(first["token_ids"])),
                       expected[0][0].routes)
    [answer] = chat["choices"]
    read = decode_routed_experts(answer["routed_experts"], len(answer["prompt_token_ids"]) + len(answer["token_ids"]))
    assert (read[:-1] >= 0).all() and (read[-1] == -1).all()
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_routed_experts"


def test_a_server_that_does_not_record_refuses_by_field(moe):
    model, tok = moe
    server, engine = _served(model, tok, record=False)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            answer = client.post("/v1/completions", json={"prompt": [5, 6], "return_routed_experts": True})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "return_routed_experts"
        assert "--enable-return-routed-experts" in answer.json()["error"]["message"]
        remote = RemoteEngine([server.url], pad_id=0, routed_experts="server", retries=0)
        with pytest.raises(ValueError, match="no routed_experts"):
            remote.generate([[5, 6]], SamplingParams(max_tokens=2))
        remote.close()
    finally:
        server.stop()
        engine.close()


def _samples(groups) -> list[Sample]:
    return [Sample(tokens=tuple(p) + c.token_ids, loss_mask=(0,) * len(p) + (1,) * len(c.token_ids),
                   logprobs=(0.0,) * len(p) + c.logprobs, prompt_len=len(p), prompt="p", completion=c.text,
                   stop_reason=c.stop_reason, routes=c.routes, advantage=1.0)
            for p, group in zip(PROMPTS, groups, strict=True) for c in group if c.stop_reason is not StopReason.ABORT]


def _mismatch(model, samples, mode):
    batch = collate(samples, [1.0] * len(samples), 0)
    backend = LocalBackend(model, learning_rate=1e-3, total_steps=1, router_replay=mode)
    return mismatch_stats(batch.old_logprobs_B_T, backend.forward(batch), batch.weights_B_T > 0)


def test_r3_through_a_loopback_server_drops_the_mismatch_as_in_process(moe):
    model, tok = moe
    params = SamplingParams(max_tokens=20, n=2, greedy=True)  # greedy: the two engines sample the same tokens
    local = _samples(_in_process(model, tok, params, torch.bfloat16))
    server, engine = _served(model, tok, autocast=torch.bfloat16)  # engine in bf16, trainer in fp32
    try:
        remote = RemoteEngine([server.url], pad_id=tok.pad_token_id, routed_experts="ask")
        served = _samples(remote.generate(PROMPTS, params))
        remote.close()
    finally:
        server.stop()
        engine.close()
    assert [s.tokens for s in served] == [s.tokens for s in local]
    stats = {(where, mode): _mismatch(model, samples, mode)
             for where, samples in (("served", served), ("local", local)) for mode in ("off", "r3")}
    assert stats["served", "off"]["mismatch/max_abs"] > 0.1 and stats["served", "r3"]["mismatch/max_abs"] < 0.05
    assert stats["served", "r3"]["mismatch/kl"] < stats["served", "off"]["mismatch/kl"] / 10
    # the same drop as the in-process engine's (bf16 rounds a little differently in another batch shape)
    for key in ("mismatch/max_abs", "mismatch/kl"):
        for mode in ("off", "r3"):
            assert stats["served", mode][key] == pytest.approx(stats["local", mode][key], rel=0.2)


def test_serve_refuses_the_flag_for_a_dense_model(tiny_model_path, capsys):
    from tokenmill.cli import main

    assert main(["serve", tiny_model_path, "--port", "0", "--enable-return-routed-experts"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("tokenmill serve: --enable-return-routed-experts: the model has no mixture-of-experts")
