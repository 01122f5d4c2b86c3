"""Sampling from a real vLLM server through `RemoteEngine`: the returned logprobs are the teacher-forced
logprobs of the tempered distribution (within 1e-4 in fp32), greedy picks the argmax, stops and EOS are kept."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams, StopReason


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # ids past the special tokens (7..102: characters)
    return [[rng.randrange(7, 103) for _ in range(rng.randrange(2, 40))] for _ in range(count)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_teacher_forcing(vllm_server, hf_model, temperature):
    engine = RemoteEngine([vllm_server.url], pad_id=0)
    try:
        prompts = _prompts(4, seed=int(temperature * 10))
        out = engine.generate(prompts, SamplingParams(max_tokens=12, n=3, temperature=temperature))
    finally:
        engine.close()
    worst, tokens = 0.0, 0
    for prompt, completions in zip(prompts, out):
        assert len(completions) == 3
        for c in completions:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            ref = teacher_logprobs(hf_model, prompt, c.token_ids, temperature=temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref)))
            tokens += len(ref)
    assert tokens >= 12  # something was compared
    assert worst <= 1e-4, f"max |vLLM - teacher| = {worst:.3g} over {tokens} tokens at T={temperature}"


def test_greedy_is_the_argmax_and_eos_is_kept(vllm_server, hf_model):
    engine = RemoteEngine([vllm_server.url], pad_id=0)
    try:
        prompt = _prompts(1, seed=5)[0]
        [[c]] = engine.generate([prompt], SamplingParams(max_tokens=10, greedy=True))
    finally:
        engine.close()
    ids = list(prompt)
    with torch.no_grad():
        for t in c.token_ids:  # each token is the argmax after the ones before it
            assert t == int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(t)
    if c.stop_reason is StopReason.STOP:  # an EOS ends the ids and carries its logprob
        assert c.token_ids[-1] == 2
    else:
        assert len(c.token_ids) == 10
