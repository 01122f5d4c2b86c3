"""Weights into a real vLLM server by gloo broadcast (`engine.sync: vllm_broadcast`): the server's workers run
tokenmill's worker extension and join the trainer's group through `/collective_rpc`. After a push, and after a
3-step GRPO run that pushed every step this way, vLLM's logprobs are the trainer's within 1e-4.

Every test leaves the server on the model's starting weights."""

from __future__ import annotations

import torch
from test_vllm_weight_sync import _restore, _weight_version, _worst, train_and_compare

from tokenmill.engines import vllm
from tokenmill.engines.remote.client import RemoteEngine


def test_a_broadcast_push_lands_and_a_second_one_replaces_it(vllm_server, vllm_model, hf_model, tmp_path):
    long_prompt = [7 + (i * 13) % 96 for i in range(300)]  # many KV blocks: cached across requests
    short = [[10, 11, 12], [40, 41]]
    moved = []
    for seed in (1, 2):  # two different models: every weight moved (head included)
        torch.manual_seed(seed)
        m = type(hf_model).from_pretrained(vllm_model, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        moved.append(m)
    sync = vllm.VLLMBroadcastSync([vllm_server.url], timeout_s=60)
    engine = RemoteEngine([vllm_server.url], pad_id=0, sync=sync)
    try:
        assert _worst(engine, hf_model, [long_prompt] + short) <= 1e-4  # the start weights; the prefix cached
        engine.update_weights(moved[0].named_parameters(), version=5)
        first = _worst(engine, moved[0], [long_prompt] + short)
        version = _weight_version(vllm_server.url)
        engine.update_weights(moved[1].named_parameters(), version=6)  # the same group, a second push
        second, stale = _worst(engine, moved[1], short), _worst(engine, moved[0], short)
    finally:
        engine.close()
        _restore(vllm_server.url, vllm_model, tmp_path / "restore")
    assert version == "5" and _weight_version(vllm_server.url) == "0"
    assert first <= 1e-4, f"after the broadcast vLLM is {first:.3g} from the pushed weights"
    assert second <= 1e-4 and stale > 1e-2, (second, stale)


def test_grpo_over_broadcast_ends_with_vllm_on_the_trained_weights(vllm_server, vllm_model, hf_model,
                                                                    train_on_vllm, tmp_path):
    rows, on_trained, on_start, version = train_and_compare(vllm_server, vllm_model, hf_model, train_on_vllm,
                                                            tmp_path, sync="vllm_broadcast")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # every rollout came from vLLM on the weights the trainer had: the run's own mismatch metrics and probe say so
    assert all(r["mismatch/mean_abs"] <= 1e-4 and r["mismatch/max_abs"] <= 1e-3 for r in steps), \
        [(r["mismatch/mean_abs"], r["mismatch/max_abs"]) for r in steps]
    assert all(r["mismatch/out_of_range_frac"] == 0.0 for r in steps)
    assert [r.get("probe/ok") for r in steps] == [1.0] * 3  # the weight-sync probe after each step's push
    assert version == "3"
    assert on_trained <= 1e-4, f"vLLM is {on_trained:.3g} from the trained weights"
    assert on_start > 1e-3, f"the run did not move the weights (vLLM {on_start:.3g} from the start)"
