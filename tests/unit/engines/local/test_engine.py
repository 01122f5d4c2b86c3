"""HFEngine on a tiny real model: sampled-token logprobs against a teacher-forced forward pass."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmill.engines import HFEngine, InferenceEngine
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams, StopReason

PROMPTS = ["12+34=", "7+5=", "The sum of 100 and 23 is "]  # different lengths: left padding in the engine


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@torch.no_grad()
def greedy_loop(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_engine_satisfies_protocol(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    assert isinstance(engine, InferenceEngine)
    assert engine.version == 0 and engine.eos_ids == {tokenizer.eos_token_id}


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sampled_logprobs_match_teacher_forcing(tiny_model, tokenizer, prompts, temperature):
    engine = HFEngine(tiny_model, tokenizer, seed=1)
    params = SamplingParams(max_tokens=8, n=3, temperature=temperature)
    out = engine.generate(prompts, params)
    assert len(out) == len(prompts) and all(len(group) == 3 for group in out)
    for prompt, group in zip(prompts, out):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            expected = teacher_logprobs(tiny_model, prompt, c.token_ids, temperature)
            assert c.logprobs == pytest.approx(expected, abs=1e-4)
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    # with n=3 the three samples of one prompt are not all the same
    assert len({c.token_ids for c in out[0]}) > 1


def test_early_stops_and_row_compaction_keep_logprobs_right(tiny_model, tokenizer, prompts):
    # make a fifth of the vocabulary end a sequence, so rows stop at different steps and the engine drops
    # finished rows from its batch (KV-cache compaction) while the others keep decoding
    tiny_model.generation_config.eos_token_id = list(range(2, len(tokenizer), 5))
    engine = HFEngine(tiny_model, tokenizer, seed=3, compact_fraction=0.1)
    out = engine.generate(prompts, SamplingParams(max_tokens=12, n=4))
    completions = [c for group in out for c in group]
    lengths = {len(c.token_ids) for c in completions}
    assert len(lengths) > 2  # rows really finished at different times
    for prompt, group in zip(prompts, out):
        for c in group:
            assert c.logprobs == pytest.approx(teacher_logprobs(tiny_model, prompt, c.token_ids), abs=1e-4)
            stopped = c.token_ids[-1] in engine.eos_ids
            assert c.stop_reason is (StopReason.STOP if stopped else StopReason.LENGTH)
            assert not any(t in engine.eos_ids for t in c.token_ids[:-1])  # nothing sampled after eos
            if not stopped:
                assert len(c.token_ids) == 12


def test_greedy_is_the_argmax_continuation(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    out = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True, n=2))
    for prompt, group in zip(prompts, out):
        expected = greedy_loop(tiny_model, prompt, 6)
        assert [c.token_ids for c in group] == [tuple(expected)] * 2
        assert group[0].logprobs == pytest.approx(teacher_logprobs(tiny_model, prompt, group[0].token_ids), abs=1e-4)


def test_top_k_one_equals_greedy(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer, seed=5)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=6, top_k=1, temperature=0.8))
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in greedy]
    # the reported logprob is still the full tempered distribution's, not log 1 = 0
    for prompt, group in zip(prompts, top1):
        expected = teacher_logprobs(tiny_model, prompt, group[0].token_ids, 0.8)
        assert group[0].logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp < -0.01 for lp in group[0].logprobs)


def test_max_tokens_gives_length(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    out = engine.generate(prompts, SamplingParams(max_tokens=5, greedy=True))
    assert all(tokenizer.eos_token_id not in g[0].token_ids for g in out)  # this random model never says eos
    for group in out:
        assert len(group[0].token_ids) == 5
        assert group[0].stop_reason is StopReason.LENGTH
    one = engine.generate(prompts[:1], SamplingParams(max_tokens=1))
    assert len(one[0][0].token_ids) == 1 and one[0][0].stop_reason is StopReason.LENGTH


def test_eos_stops_with_stop_reason(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    [[free]] = engine.generate(prompts[:1], SamplingParams(max_tokens=6, greedy=True))
    # declare the third greedy token an end-of-sequence token: decoding must stop right after it
    stop_tok = free.token_ids[2]
    k = free.token_ids.index(stop_tok)
    tiny_model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_tok]
    engine = HFEngine(tiny_model, tokenizer)
    [[c]] = engine.generate(prompts[:1], SamplingParams(max_tokens=6, greedy=True))
    assert c.token_ids == free.token_ids[: k + 1]
    assert c.stop_reason is StopReason.STOP


def test_stop_string_cuts_the_text(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    [[free]] = engine.generate(prompts[:1], SamplingParams(max_tokens=8, greedy=True))
    text = free.text
    assert len(text) >= 4  # one printable character per token
    stop = text[2:4]
    cut = text.find(stop)
    [[c]] = engine.generate(prompts[:1], SamplingParams(max_tokens=8, greedy=True, stop=(stop,)))
    assert c.stop_reason is StopReason.STOP
    assert c.text == text[:cut]
    assert stop not in c.text
    # decoding stopped at the token that completed the stop string
    assert c.token_ids == free.token_ids[: cut + len(stop)]


def test_same_seed_same_samples(tiny_model, tokenizer, prompts):
    params = SamplingParams(max_tokens=8, n=2)
    a = HFEngine(tiny_model, tokenizer, seed=11).generate(prompts, params)
    b = HFEngine(tiny_model, tokenizer, seed=11).generate(prompts, params)
    c = HFEngine(tiny_model, tokenizer, seed=12).generate(prompts, params)
    assert a == b
    assert [x.token_ids for g in a for x in g] != [x.token_ids for g in c for x in g]


def test_update_weights_copies_in_place(tiny_model, tokenizer, prompts):
    engine = HFEngine(tiny_model, tokenizer)
    ptrs = {n: p.data_ptr() for n, p in tiny_model.named_parameters()}
    before = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))

    trained = copy.deepcopy(tiny_model)
    with torch.no_grad():
        trained.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        trained.model.norm.weight.add_(0.5)
    engine.update_weights(trained.named_parameters(), version=7)

    assert engine.version == 7
    assert {n: p.data_ptr() for n, p in tiny_model.named_parameters()} == ptrs  # same storage, new values
    for (name, mine), (_, theirs) in zip(tiny_model.named_parameters(), trained.named_parameters()):
        assert torch.equal(mine, theirs), name
        assert mine.data_ptr() != theirs.data_ptr()
    after = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    assert [g[0].logprobs for g in after] != [g[0].logprobs for g in before]
    for prompt, group in zip(prompts, after):
        assert list(group[0].token_ids) == greedy_loop(trained, prompt, 6)
        assert group[0].logprobs == pytest.approx(teacher_logprobs(trained, prompt, group[0].token_ids), abs=1e-4)


def test_update_weights_from_shared_module_is_a_no_op_copy(tiny_model, tokenizer):
    engine = HFEngine(tiny_model, tokenizer)
    before = {n: p.clone() for n, p in tiny_model.named_parameters()}
    engine.update_weights(tiny_model.named_parameters(), version=3)
    assert engine.version == 3
    assert all(torch.equal(p, before[n]) for n, p in tiny_model.named_parameters())
