"""The remote engine client against real `tokenmill serve` processes on loopback: exact tokens and logprobs,
load spread across two servers, failover when one is killed mid-run, clear errors when all are gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tokenmill.engines.remote.client import RemoteEngine
from tokenmill.engines.remote.pool import EngineRequestError, EngineUnavailable
from tokenmill.testing.reference import teacher_logprobs
from tokenmill.types import SamplingParams, StopReason


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_path: str, seed: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", model_path, "--port", str(port), "--seed", str(seed)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("tokenmill serve did not start within 60 s")


@pytest.fixture(scope="module")
def two_servers(tiny_model_path):
    procs = [_serve(tiny_model_path, seed) for seed in (1, 2)]
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_remote_samples_are_exact_tokens_with_the_models_logprobs(two_servers, tiny_model, tokenizer):
    engine = RemoteEngine([url for _, url in two_servers], pad_id=tokenizer.pad_token_id, timeout_s=60)
    prompts = [list(tokenizer(p)["input_ids"]) for p in ["12+34=", "7+8=", "99+1="]]
    out = engine.generate(prompts, SamplingParams(max_tokens=6, n=3, temperature=1.0))
    assert [len(group) for group in out] == [3, 3, 3]
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 6
            assert c.stop_reason in (StopReason.STOP, StopReason.LENGTH)
            want = teacher_logprobs(tiny_model, prompt, list(c.token_ids))
            assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < 1e-4
    greedy = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    again = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    assert [g[0].token_ids for g in greedy] == [g[0].token_ids for g in again]  # both servers agree
    engine.close()


def test_prompts_batched_one_request_per_server_come_back_to_their_own_prompts(two_servers, tiny_model, tokenizer):
    """prompts_per_request=0: 5 prompts over 2 servers go out as requests of 3 and 2 prompts; each prompt's
    samples are its own (greedy: the tokens of that prompt alone; sampled: the model's logprobs of them)."""
    urls = [url for _, url in two_servers]
    batched = RemoteEngine(urls, pad_id=tokenizer.pad_token_id, timeout_s=60, prompts_per_request=0)
    single = RemoteEngine(urls, pad_id=tokenizer.pad_token_id, timeout_s=60)
    assert batched._spans(5) == [(0, 3), (3, 5)] and single._spans(2) == [(0, 1), (1, 2)]
    prompts = [list(tokenizer(p)["input_ids"]) for p in ["12+34=", "7+8=", "99+1=", "5+5=", "40+2="]]
    greedy = SamplingParams(max_tokens=6, greedy=True)
    served_before = sum(s["served"] for s in batched.pool.stats().values())
    got = batched.generate(prompts, greedy)
    assert sum(s["served"] for s in batched.pool.stats().values()) - served_before == 2  # two requests
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in single.generate(prompts, greedy)]
    sampled = batched.generate(prompts, SamplingParams(max_tokens=6, n=2, temperature=1.0))
    assert [len(group) for group in sampled] == [2] * 5
    for prompt, group in zip(prompts, sampled, strict=True):
        for c in group:
            want = teacher_logprobs(tiny_model, prompt, list(c.token_ids))
            assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < 1e-4
    batched.close()
    single.close()


def test_a_seeded_request_gives_prompt_i_the_seed_plus_i(two_servers, tokenizer):
    url = two_servers[0][1]
    body = {"max_tokens": 6, "n": 2, "temperature": 1.0, "return_token_ids": True}
    prompt = list(tokenizer("12+34=")["input_ids"])
    together = httpx.post(f"{url}/v1/completions", json=body | {"prompt": [prompt, prompt], "seed": 41},
                          timeout=60).json()["choices"]
    ids = [tuple(c["token_ids"]) for c in sorted(together, key=lambda c: c["index"])]
    alone = [[tuple(c["token_ids"]) for c in httpx.post(f"{url}/v1/completions", json=body | {
        "prompt": prompt, "seed": seed}, timeout=60).json()["choices"]] for seed in (41, 42)]
    assert ids[:2] == alone[0] and ids[2:] == alone[1]
    assert ids[:2] != ids[2:]  # the same prompt twice in one request: not the same samples


def test_load_is_spread_and_a_bad_request_is_not_retried(two_servers, tokenizer):
    engine = RemoteEngine([url for _, url in two_servers], pad_id=0, timeout_s=60)
    engine.generate([[5, 6, 7]] * 32, SamplingParams(max_tokens=4))
    served = [s["served"] for s in engine.pool.stats().values()]
    assert sum(served) == 32 and min(served) >= 8, served
    with pytest.raises(EngineRequestError) as err:
        engine.generate([[10**6]], SamplingParams(max_tokens=2))  # outside the vocabulary
    assert err.value.status == 400 and "vocabulary" in str(err.value)
    assert sum(s["served"] for s in engine.pool.stats().values()) == 32
    engine.close()


def test_killing_one_of_two_servers_mid_run_moves_requests_to_the_other(tiny_model_path):
    victim, survivor = _serve(tiny_model_path, 3), _serve(tiny_model_path, 4)
    try:
        engine = RemoteEngine([victim[1], survivor[1]], pad_id=0, timeout_s=30, retries=2, backoff_s=0.1)
        rounds: list[int] = []

        def run() -> None:  # a "run": 12 rounds of 16 prompts x 2 samples
            for _ in range(12):
                out = engine.generate([[5, 6, 7, 8]] * 16, SamplingParams(max_tokens=8, n=2))
                rounds.append(sum(len(g) for g in out))

        worker = threading.Thread(target=run)
        worker.start()
        while len(rounds) < 3:
            time.sleep(0.01)
        victim[0].send_signal(signal.SIGKILL)
        worker.join(120)
        assert not worker.is_alive() and rounds == [32] * 12
        stats = engine.pool.stats()
        assert stats[victim[1]]["failures"] >= 1 and stats[victim[1]]["last_error"]
        assert stats[survivor[1]]["served"] >= 9 * 16 // 2  # it took at least the rounds after the kill
        # with no server left the client gives up with one error naming each server
        survivor[0].send_signal(signal.SIGKILL)
        survivor[0].wait(10)
        with pytest.raises(EngineUnavailable) as err:
            engine.generate([[5, 6]], SamplingParams(max_tokens=2))
        assert victim[1] in str(err.value) and survivor[1] in str(err.value)
        engine.close()
    finally:
        for proc, _ in (victim, survivor):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_a_training_run_survives_losing_one_of_its_two_servers(tiny_model_path, tmp_path):
    """The fault test at run level: async GRPO on two remote servers; one is SIGKILLed after two steps; the
    run's requests and weight pushes move to the other and all steps finish."""
    import json

    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    torch.set_num_threads(1)
    victim, survivor = _serve(tiny_model_path, 5), _serve(tiny_model_path, 6)
    metrics = tmp_path / "metrics.jsonl"
    try:
        cfg = load_config(RLConfig, {
            "model": {"path": tiny_model_path},
            "data": {"task": "addition", "num_train": 500, "num_eval": 0},
            "generation": {"group_size": 4, "max_tokens": 4},
            "training": {"learning_rate": 1e-3, "seed": 3},
            "controller": {"steps": 8, "prompts_per_step": 8, "max_staleness": 1},
            "engine": {"placement": "remote", "urls": [victim[1], survivor[1]], "timeout_s": 30, "threads": 1},
            "tracking": {"output_dir": str(tmp_path), "console": "none"},
            "checkpoint": {"every": 0, "save_final": False},
        })

        def kill_after_two_steps() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                lines = metrics.read_text().splitlines() if metrics.exists() else []
                if sum('"reward/mean"' in line for line in lines) >= 2:
                    victim[0].send_signal(signal.SIGKILL)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_after_two_steps)
        killer.start()
        run = build_run(cfg)
        try:
            run_rl(run)
        finally:
            run.close()
        killer.join(5)
        assert victim[0].poll() is not None  # it really died mid-run
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"reward/mean"' in line]
        assert len(steps) == 8 and all(s["reward/unscored"] == 0 for s in steps)
        # the survivor has every push: it reports the last policy version
        assert httpx.get(f"{survivor[1]}/health", timeout=5).json()["policy_version"] >= 7
    finally:
        for proc, _ in (victim, survivor):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
