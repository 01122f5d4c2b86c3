"""ContinuousEngine on the tiny real model: speed over serial, exact logprobs, joining mid-decode, weight updates."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tokenmill.engines import InferenceEngine
from tokenmill.engines.local.continuous import ContinuousEngine, EngineUnavailable
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams, StopReason

TIMEOUT_S = 60


@torch.no_grad()
def greedy_alone(model, prompt, steps: int) -> tuple[int, ...]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tuple(ids[len(prompt) :])


def mixed_requests(tokenizer, count: int = 32):
    """Prompts of 2..40 characters and max_tokens of 8..64, deterministic."""
    prompts = [tokenizer("".join("0123456789+=ab"[(i * 7 + k) % 14] for k in range(2 + (i * 11) % 39)),
                         add_special_tokens=False)["input_ids"] for i in range(count)]
    return [(p, 8 + (i * 17) % 57) for i, p in enumerate(prompts)]


@pytest.fixture
def engine(tiny_model, tokenizer):
    with ContinuousEngine(copy.deepcopy(tiny_model), tokenizer, seed=0) as eng:
        yield eng


def wait_until(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def test_satisfies_protocol_and_generate_groups(engine, tokenizer):
    assert isinstance(engine, InferenceEngine)
    prompts = [p for p, _ in mixed_requests(tokenizer, 3)]
    out = engine.generate(prompts, SamplingParams(max_tokens=5, n=3))
    assert [len(g) for g in out] == [3, 3, 3]
    assert all(len(c.token_ids) == len(c.logprobs) for g in out for c in g)


def test_32_concurrent_mixed_requests_faster_than_serial_with_exact_logprobs(tiny_model, tokenizer):
    # a 25th of the vocabulary ends a sequence, so rows also retire early, at different steps
    model = copy.deepcopy(tiny_model)
    model.generation_config.eos_token_id = list(range(7, len(tokenizer), 25))
    requests = mixed_requests(tokenizer)
    with ContinuousEngine(model, tokenizer) as engine, ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda _: None, range(64)))  # threads started before the clock runs
        engine.generate([requests[0][0]], SamplingParams(max_tokens=2))  # warm-up
        start = time.perf_counter()
        serial = [engine.submit(p, SamplingParams(max_tokens=m), seed=i).result(TIMEOUT_S)
                  for i, (p, m) in enumerate(requests)]
        serial_s = time.perf_counter() - start

        def client(i: int):
            time.sleep(0.0003 * (i % 8))  # staggered arrivals: requests join a batch that is already running
            p, m = requests[i]
            return engine.submit(p, SamplingParams(max_tokens=m), seed=i).result(TIMEOUT_S)

        concurrent_s = float("inf")
        for _ in range(2):  # the shorter of two runs: a short run is the one other processes' noise distorts
            start = time.perf_counter()
            concurrent = list(pool.map(client, range(32)))
            concurrent_s = min(concurrent_s, time.perf_counter() - start)
        prefills = engine.prefills
    print(f"\n32 mixed requests: serial {serial_s:.3f}s, concurrent {concurrent_s:.3f}s, "
          f"speed-up {serial_s / concurrent_s:.1f}x")
    assert serial_s / concurrent_s >= 2.0
    assert prefills < 33 + 64  # concurrent admission batched several requests into one prefill
    lengths = {len(c[0].token_ids) for c in concurrent}
    assert len(lengths) > 5 and any(c[0].stop_reason is StopReason.STOP for c in concurrent)
    worst = 0.0
    for (prompt, max_tokens), [c], [alone] in zip(requests, concurrent, serial, strict=True):
        assert 1 <= len(c.token_ids) <= max_tokens
        expected = teacher_logprobs(model, prompt, c.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)))
        assert c.token_ids == alone.token_ids  # a seeded request samples the same tokens in any company
    assert worst <= 1e-4


def test_requests_joining_mid_decode_get_their_greedy_tokens(engine, tiny_model, tokenizer):
    (long_prompt, _), (p1, _), (p2, _) = mixed_requests(tokenizer, 3)
    first = engine.submit(long_prompt, SamplingParams(max_tokens=120, greedy=True))
    wait_until(lambda: first.admitted_step is not None and engine.steps >= first.admitted_step + 10)
    second = engine.submit(p1, SamplingParams(max_tokens=30, greedy=True, n=2))
    wait_until(lambda: second.admitted_step is not None)
    third = engine.submit(p2, SamplingParams(max_tokens=7, greedy=True))
    [a], [b1, b2], [c] = (f.result(TIMEOUT_S) for f in (first, second, third))
    assert first.admitted_step < second.admitted_step <= third.admitted_step < first.finished_step
    assert a.token_ids == greedy_alone(tiny_model, long_prompt, 120)
    assert b1.token_ids == b2.token_ids == greedy_alone(tiny_model, p1, 30)
    assert c.token_ids == greedy_alone(tiny_model, p2, 7)
    assert b1.logprobs == pytest.approx(teacher_logprobs(tiny_model, p1, b1.token_ids), abs=1e-4)


def test_n_samples_share_one_prefill_and_seeds_reproduce(engine, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    before = engine.prefills
    group = engine.submit(prompt, SamplingParams(max_tokens=12, n=6), seed=3).result(TIMEOUT_S)
    assert engine.prefills == before + 1 and len(group) == 6
    assert len({c.token_ids for c in group}) > 1  # n rows sample independently
    again = engine.submit(prompt, SamplingParams(max_tokens=12, n=6), seed=3).result(TIMEOUT_S)
    other = engine.submit(prompt, SamplingParams(max_tokens=12, n=6), seed=4).result(TIMEOUT_S)
    assert [c.token_ids for c in again] == [c.token_ids for c in group]
    assert [c.token_ids for c in other] != [c.token_ids for c in group]


def scaled_copy(model, scale: float):
    """A copy of `model` with every weight times `scale` (other weights, the same architecture)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(scale)
    return new


def _shifted_weights(model, scale: float):
    return [(name, p.detach() * scale) for name, p in model.named_parameters()]


def test_weight_update_waits_for_running_requests_which_finish_on_old_weights(engine, tiny_model, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    new_model = scaled_copy(tiny_model, 1.5)
    running = engine.submit(prompt, SamplingParams(max_tokens=150, greedy=True))  # greedy: no early eos
    wait_until(lambda: running.admitted_step is not None)
    engine.update_weights(new_model.named_parameters(), version=7)  # returns once swapped
    assert running.done() and engine.version == 7
    [old] = running.result()
    assert running.policy_version == 0 and len(old.token_ids) == 150
    assert old.logprobs == pytest.approx(teacher_logprobs(tiny_model, prompt, old.token_ids), abs=1e-4)
    later = engine.submit(prompt, SamplingParams(max_tokens=20), seed=1)
    [new] = later.result(TIMEOUT_S)
    assert later.policy_version == 7
    assert new.logprobs == pytest.approx(teacher_logprobs(new_model, prompt, new.token_ids), abs=1e-4)


def test_staged_update_returns_at_once_and_lands_when_running_requests_finish(engine, tiny_model, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    new_model = scaled_copy(tiny_model, 1.5)
    running = engine.submit(prompt, SamplingParams(max_tokens=300, greedy=True))  # greedy: no early eos
    wait_until(lambda: running.admitted_step is not None)
    half = [(n, p.detach().clone()) for n, p in new_model.named_parameters()]
    applied, busy = engine.stage_weights(half[: len(half) // 2], version=6)
    applied_again, _ = engine.stage_weights(half[len(half) // 2 :], version=7)  # merges into the first
    # the caller was not held: the request is still decoding on the old weights, nothing applied yet
    assert busy and applied is applied_again and not applied.is_set() and not running.done()
    assert engine.version == 0 and engine.pending_version == 7
    later = engine.submit(prompt, SamplingParams(max_tokens=20), seed=1)  # after the call: new weights only
    assert applied.wait(TIMEOUT_S) and engine.version == 7
    [old] = running.result(TIMEOUT_S)
    assert running.policy_version == 0 and len(old.token_ids) == 300
    assert old.logprobs == pytest.approx(teacher_logprobs(tiny_model, prompt, old.token_ids), abs=1e-4)
    [new] = later.result(TIMEOUT_S)
    assert later.policy_version == 7 and later.admitted_step >= running.finished_step
    assert new.logprobs == pytest.approx(teacher_logprobs(new_model, prompt, new.token_ids), abs=1e-4)
    # scoring waits for a staged update: it sees the weights staged before the call
    engine.stage_weights(tiny_model.named_parameters(), version=8)
    [(scored, _)] = engine.score_ranked([prompt + list(new.token_ids)])
    assert engine.version == 8
    assert scored.token_logprobs[len(prompt) - 1 :] == pytest.approx(
        teacher_logprobs(tiny_model, prompt, new.token_ids), abs=1e-4)


def test_interrupting_update_aborts_running_requests_with_their_tokens(engine, tiny_model, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    running = engine.submit(prompt, SamplingParams(max_tokens=400, n=2, greedy=True))
    wait_until(lambda: running.admitted_step is not None and engine.steps > running.admitted_step + 3)
    engine.update_weights(_shifted_weights(tiny_model, 1.0), version=1, interrupt=True)
    group = running.result(TIMEOUT_S)
    assert engine.version == 1 and running.policy_version == 0
    for c in group:
        assert c.stop_reason is StopReason.ABORT and 3 <= len(c.token_ids) < 400
        assert c.logprobs == pytest.approx(teacher_logprobs(tiny_model, prompt, c.token_ids), abs=1e-4)


def test_update_times_out_when_running_requests_do_not_finish(engine, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    running = engine.submit(prompt, SamplingParams(max_tokens=400, greedy=True))  # greedy: never says eos
    wait_until(lambda: running.admitted_step is not None)
    with pytest.raises(TimeoutError, match="interrupt=True"):
        engine.update_weights([], version=5, timeout_s=0.01)
    assert engine.version == 0
    assert len(running.result(TIMEOUT_S)[0].token_ids) == 400  # the request went on undisturbed


def test_cancel_and_abort_all_end_requests_early(engine, tokenizer):
    prompt = mixed_requests(tokenizer, 1)[0][0]
    a = engine.submit(prompt, SamplingParams(max_tokens=400, greedy=True))  # greedy: no early eos
    b = engine.submit(prompt, SamplingParams(max_tokens=400, greedy=True))
    wait_until(lambda: a.admitted_step is not None and b.admitted_step is not None)
    engine.cancel(a)
    [ca] = a.result(TIMEOUT_S)
    assert ca.stop_reason is StopReason.ABORT and len(ca.token_ids) < 400
    engine.abort_all()
    [cb] = b.result(TIMEOUT_S)
    assert cb.stop_reason is StopReason.ABORT and len(cb.token_ids) < 400
    assert engine.stats()["running_rows"] == 0


def test_bad_requests_are_refused_with_the_field(engine, tokenizer):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.submit([5] * 600, SamplingParams())
    with pytest.raises(ValueError, match="n: 300"):
        engine.submit([5], SamplingParams(n=300))


def test_a_crashed_loop_fails_every_pending_request_with_the_cause(tiny_model, tokenizer):
    model = copy.deepcopy(tiny_model)
    calls = []

    def explode_on_tenth(*_):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("kaboom in the forward pass")

    model.register_forward_hook(explode_on_tenth)
    engine = ContinuousEngine(model, tokenizer)
    try:
        futures = [engine.submit([5, 6, 7], SamplingParams(max_tokens=50, greedy=True)) for _ in range(3)]
        for f in futures:
            exc = f.exception(TIMEOUT_S)
            assert isinstance(exc, EngineUnavailable) and "kaboom" in str(exc)
            assert isinstance(exc.__cause__, RuntimeError)
        with pytest.raises(EngineUnavailable, match="kaboom"):
            engine.submit([5], SamplingParams())
        with pytest.raises(EngineUnavailable):
            engine.update_weights([], version=1)
    finally:
        engine.close()
    assert not any(t.name == "tokenmill-continuous" and t.is_alive() for t in threading.enumerate()
                   if t is engine._thread)


def test_on_token_reports_every_sampled_token_in_order(engine):
    """Streaming's hook: (row, token, logprob) for each sampled token, from the loop, before the future resolves."""
    seen: list[tuple[int, int, float]] = []
    future = engine.submit([5, 6, 7], SamplingParams(max_tokens=6, n=3, temperature=0.8), seed=4,
                           on_token=lambda row, token, logprob: seen.append((row, token, logprob)))
    completions = future.result(timeout=60)
    for row, c in enumerate(completions):
        assert [(t, lp) for r, t, lp in seen if r == row] == list(zip(c.token_ids, c.logprobs, strict=True))
    assert len(seen) == sum(len(c.token_ids) for c in completions)
