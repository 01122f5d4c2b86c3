"""samples.jsonl records the advantage each sample trained with (logged after advantages are assigned)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

import tokenmill

GROUP, PROMPTS = 4, 2


def char_code(prompts, completions, **_):
    """Dense, so samples inside a group differ (whatever the untrained model writes): the completion's
    character codes summed, modulo 101, scaled to [0, 1]."""
    return [sum(map(ord, c)) % 101 / 100 for c in completions]


def _run(model: str, out, **algorithm) -> list[dict]:
    torch.set_num_threads(1)
    tokenmill.train({
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 50, "num_eval": 0, "task_reward_weight": 0.0},
        "generation": {"group_size": GROUP, "max_tokens": 6},
        "algorithm": algorithm,
        "training": {"seed": 1},
        "controller": {"steps": 1, "prompts_per_step": PROMPTS},
        "tracking": {"output_dir": str(out), "console": "none", "log_samples": GROUP * PROMPTS},
        "checkpoint": {"save_final": False},
    }, rewards=[char_code])
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_logged_advantages_are_the_grpo_advantages_of_the_logged_rewards(tiny_model_path, tmp_path):
    records = _run(tiny_model_path, tmp_path / "grpo")
    assert len(records) == GROUP * PROMPTS
    groups = [records[i : i + GROUP] for i in range(0, len(records), GROUP)]
    assert any(len({r["reward"] for r in g}) > 1 for g in groups)  # some group has a spread to learn from
    for g in groups:
        rewards = [r["reward"] for r in g]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)  # GRPO: unbiased std, eps 1e-4
        for r in g:
            assert r["advantage"] == pytest.approx((r["reward"] - mean) / (std + 1e-4), abs=1e-9)
    assert any(r["advantage"] != 0.0 for r in records)
    for r in records:  # the token view: every completion token, with the logprob it was sampled with
        assert 0 < len(r["tokens"]) <= 6 and all(lp is not None and lp <= 0 for _, lp in r["tokens"])


def test_with_a_critic_the_logged_advantage_is_the_mean_token_advantage(tiny_model_path, tmp_path):
    records = _run(tiny_model_path, tmp_path / "gae", advantage="gae")
    # GAE with the untrained critic's values: a non-zero advantage for every scored sample
    assert all(math.isfinite(r["advantage"]) for r in records)
    assert sum(r["advantage"] != 0.0 for r in records) >= GROUP


def test_a_logged_sample_carries_its_tokens_with_the_engines_and_the_trainers_logprobs(tiny_model_path):
    """`tokens` of a samples.jsonl record: each completion token's text and the logprob it was sampled with,
    within 1e-5 of the engine's and of the trainer's recomputation (teacher-forced, temperature 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.controller.evaluate import sample_records
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.types import Group, Sample, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = list(tok("12+3=")["input_ids"])
    [drawn] = HFEngine(model, tok, seed=3).generate([ids], SamplingParams(max_tokens=6, n=3, temperature=1.0))
    samples = tuple(Sample(tokens=(*ids, *c.token_ids), loss_mask=(0,) * len(ids) + (1,) * len(c.token_ids),
                           logprobs=(0.0,) * len(ids) + tuple(c.logprobs), prompt_len=len(ids), prompt="12+3=",
                           completion=c.text, stop_reason=c.stop_reason) for c in drawn)
    records = sample_records([Group(0, samples)], 3, tok)
    assert "tokens" not in sample_records([Group(0, samples)], 3)[0]  # no tokenizer, no token view
    for record, c, s in zip(records, drawn, samples, strict=True):
        texts, logged = zip(*record["tokens"], strict=True)
        assert "".join(texts) == tok.decode(list(c.token_ids)) and len(texts) == len(c.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0, len(ids) - 1:-1]
        trainer = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0].tolist()
        assert logged == pytest.approx(tuple(c.logprobs), abs=1e-5)
        assert logged == pytest.approx(tuple(trainer), abs=1e-5)
