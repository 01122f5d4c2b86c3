"""WorkerEngine: the in-process engine in a worker process, on a tiny real model. It samples what HFEngine samples
with the same seed, takes pushed weights only when asked between rollouts, and fails by name when a request fails,
times out or its worker dies."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from tokenmill.engines import HFEngine
from tokenmill.engines.base import EngineUnavailable, InferenceEngine, call_seed
from tokenmill.engines.local.worker import WorkerEngine
from tokenmill.types import SamplingParams

PARAMS = SamplingParams(max_tokens=6, n=3, temperature=1.0)


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+5=", "1+1=")]


def _in_process(model, tokenizer, prompts, seed: int, version: int, index: int):
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    engine.generator.manual_seed(call_seed(seed, version, index))
    return engine.generate(prompts, PARAMS)


def _same(a, b) -> None:
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-6)


def test_worker_samples_like_the_in_process_engine_takes_weights_between_rollouts_and_fails_by_name(tiny_model, tokenizer):
    prompts = _prompts(tokenizer)
    engine = WorkerEngine(tiny_model, tokenizer, seed=5, threads=1)
    try:
        assert isinstance(engine, InferenceEngine) and engine.pad_id == tokenizer.pad_token_id
        first = engine.generate(prompts, PARAMS)
        _same(first, _in_process(tiny_model, tokenizer, prompts, seed=5, version=0, index=0))
        assert len({c.token_ids for g in first for c in g}) > 1  # sampled, not one repeated answer

        new = copy.deepcopy(tiny_model)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.update_weights(new.named_parameters(), version=3)
        # staged only: the next rollout still samples from version 0 (its second call)
        assert engine.version == 0
        _same(engine.generate(prompts, PARAMS), _in_process(tiny_model, tokenizer, prompts, 5, 0, 1))
        assert engine.apply_staged() is True and engine.version == 3
        assert engine.apply_staged() is False  # nothing newer staged
        _same(engine.generate(prompts, PARAMS), _in_process(new, tokenizer, prompts, 5, 3, 0))

        with pytest.raises(KeyError, match="'nope'"):
            engine.update_weights([("nope", torch.zeros(1))], version=4)
        _failures(engine, tiny_model, prompts)
    finally:
        engine.close()


def _failures(engine: WorkerEngine, model, prompts) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    with pytest.raises(EngineUnavailable, match=r"pid \d+\) failed: \w+Error"):
        engine.generate([[vocab + 5]], PARAMS)  # a token id outside the vocabulary
    assert len(engine.generate(prompts, PARAMS)) == 3  # the failed request was answered; the worker serves on
    # a push never waits for a rollout in flight (here: the socket held as a rollout holds it)
    with engine._pipe:
        pusher = threading.Thread(target=engine.update_weights, args=(model.named_parameters(), 5))
        pusher.start()
        pusher.join(10)
        assert not pusher.is_alive()
    # a worker that does not answer in time is killed (its late answer must not pass for the next one's)
    engine.timeout_s = 0.001
    with pytest.raises(EngineUnavailable, match=r"no answer within 0.001s; killed"):
        engine.generate(prompts * 8, SamplingParams(max_tokens=64, n=8))
    engine.process.wait(10)
    with pytest.raises(EngineUnavailable, match=r"pid \d+, exited with code -9"):
        engine.generate(prompts, PARAMS)


def test_a_lora_policy_stages_only_its_adapters(tiny_model, tokenizer):
    from tokenmill.config.schema import LoRAConfig
    from tokenmill.training.lora import add_lora

    policy = add_lora(tiny_model, LoRAConfig(rank=4, alpha=8), task_type="CAUSAL_LM", field="model.lora")
    engine = WorkerEngine(policy, tokenizer, seed=2, threads=1)
    try:
        assert engine.staging and all("lora_" in name for name in engine.staging)
        with torch.no_grad():  # peft starts B at zero: give the adapters an effect
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn_like(p))
        engine.update_weights(((n, p) for n, p in policy.named_parameters() if p.requires_grad), version=1)
        assert engine.apply_staged()
        prompts = _prompts(tokenizer)
        _same(engine.generate(prompts, PARAMS), _in_process(policy, tokenizer, prompts, seed=2, version=1, index=0))
    finally:
        engine.close()
    engine.close()  # idempotent
    assert engine.process.returncode == 0  # a clean exit
    assert not (Path("/dev/shm") / engine._shm.name.lstrip("/")).exists()  # the staging block is freed
    with pytest.raises(EngineUnavailable, match="closed"):
        engine.generate(prompts, PARAMS)
