"""Weights into a real vLLM server by the routes vLLM 0.32 serves (`engine.sync: vllm`): after a push, and after
a 3-step GRPO run whose rollouts all came from vLLM (synchronous, and async with max_staleness 1), vLLM's logprobs
are the trainer's within 1e-4.

Every test leaves the server on the model's starting weights (it pushes them back at the end)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tokenmill.engines import vllm
from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams


def _worst(engine: RemoteEngine, model, prompts: list[list[int]], temperature: float = 1.0) -> float:
    """Max |vLLM logprob - teacher-forced logprob under `model`| over samples of `prompts`."""
    out = engine.generate(prompts, SamplingParams(max_tokens=8, n=2, temperature=temperature))
    worst = 0.0
    for prompt, completions in zip(prompts, out):
        for c in completions:
            ref = teacher_logprobs(model, prompt, c.token_ids, temperature=temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref)))
    return worst


def _weight_version(url: str) -> str:
    return str(httpx.get(url + vllm.WEIGHT_INFO, timeout=10).json().get("weight_version"))


def _restore(url: str, model_path: str, folder) -> None:
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sync = vllm.VLLMReloadSync([url], folder, timeout_s=60)
    try:
        sync.push(start.named_parameters(), version=0)
    finally:
        sync.close()


def train_and_compare(vllm_server, vllm_model, hf_model, train_on_vllm, tmp_path, **train) -> tuple[list, float, float, str]:
    """A 3-step GRPO run with vLLM as the engine; then the run's metric rows, how far vLLM's logprobs are from
    the trained weights and from the start (worst absolute difference), and vLLM's weight version. The server
    is put back on the model folder's weights afterwards."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    try:
        train_on_vllm(out, [vllm_server.url], steps=3, **train)
        trained = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
        engine = RemoteEngine([vllm_server.url], pad_id=0)
        try:
            prompts = [[10, 11, 12, 13], [20, 30, 40], [50, 8, 9, 60, 61]]
            on_trained, on_start = _worst(engine, trained, prompts), _worst(engine, hf_model, prompts)
        finally:
            engine.close()
        version = _weight_version(vllm_server.url)
    finally:
        _restore(vllm_server.url, vllm_model, tmp_path / "restore")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, on_trained, on_start, version


def test_a_push_lands_and_the_prefix_cache_is_dropped(vllm_server, vllm_model, hf_model, tmp_path):
    long_prompt = [7 + (i * 13) % 96 for i in range(300)]  # many KV blocks: cached across requests
    short = [[10, 11, 12], [40, 41]]
    new = type(hf_model).from_pretrained(vllm_model, dtype=torch.float32).eval()
    with torch.no_grad():  # a different model: every weight moved (head included)
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    sync = vllm.VLLMReloadSync([vllm_server.url], tmp_path / "w", timeout_s=60)
    engine = RemoteEngine([vllm_server.url], pad_id=0, sync=sync)
    try:
        assert _worst(engine, hf_model, [long_prompt] + short) <= 1e-4  # the start weights; the prefix cached
        engine.update_weights(new.named_parameters(), version=5)
        after_new, after_old = _worst(engine, new, [long_prompt] + short), _worst(engine, hf_model, short)
        assert _weight_version(vllm_server.url) == "5"
    finally:
        engine.close()
        _restore(vllm_server.url, vllm_model, tmp_path / "restore")
    assert after_new <= 1e-4, f"after the push vLLM is {after_new:.3g} from the pushed weights"
    assert after_old > 1e-2  # and no longer the old model
    assert not (tmp_path / "w" / "v00000000").exists() and (tmp_path / "w" / "v00000005").is_dir()


@pytest.mark.parametrize("staleness", [0, 1])
def test_grpo_with_vllm_as_the_engine_ends_with_vllm_on_the_trained_weights(vllm_server, vllm_model, hf_model,
                                                                             train_on_vllm, tmp_path, staleness):
    rows, on_trained, on_start, version = train_and_compare(vllm_server, vllm_model, hf_model, train_on_vllm,
                                                            tmp_path, max_staleness=staleness)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert version == "3"
    assert on_trained <= 1e-4, f"vLLM is {on_trained:.3g} from the trained weights"
    assert on_start > 1e-3, f"the run did not move the weights (vLLM {on_start:.3g} from the start)"
