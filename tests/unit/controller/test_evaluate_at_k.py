"""The sampled held-out evaluation on a real tiny model: eval/pass@k, eval/maj@k and eval/avg@n are the
estimators applied to the samples the rewards scored, the numbers repeat, and the evaluation neither reads
nor moves the training's sampling stream."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter

import pytest
import torch

from tokenmill.config.schema import RLConfig
from tokenmill.types import ConfigError

SCORED: list[list[str]] = []  # each call's completions, in order


def even_length(completions, **kwargs):
    SCORED.append(list(completions))
    return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]


ROWS = [{"prompt": p} for p in ("1+2=", "3+4=", "5+6=", "7+8=")]


def _cfg(tmp_path, model: str, **controller):
    return {
        "model": {"path": model, "device": "cpu"},
        "data": {"path": str(tmp_path / "rows.jsonl"), "num_eval": 2},
        "rewards": [{"function": f"{__name__}:even_length", "isolation": "thread"}],
        "generation": {"group_size": 2, "max_tokens": 4},
        "controller": {"steps": 2, "prompts_per_step": 2, **controller},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }


def test_the_metrics_are_the_estimators_over_the_scored_samples(tmp_path, tiny_model_path):
    from tokenmill.controller.evaluate import evaluate_player
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.rewards.build import build_rewards
    from tokenmill.rollout.generator import build_generator

    cfg = RLConfig.model_validate(_cfg(tmp_path, tiny_model_path, eval_samples=5, eval_k=[1, 2, 5],
                                       eval_temperature=1.5))
    engine = HFEngine.from_pretrained(tiny_model_path, seed=0)
    rewards = build_rewards(cfg)
    player = build_generator(cfg, engine, engine.tokenizer, rewards)
    stream = engine.generator.get_state().clone()
    try:
        out = evaluate_player(player, ROWS, cfg)
        again = evaluate_player(player, ROWS, cfg)
    finally:
        rewards.close()
    assert torch.equal(engine.generator.get_state(), stream)  # the engine's own stream is where it was
    assert out == again  # a stream of its own: the same numbers every time
    greedy, sampled = SCORED[-4], SCORED[-3]  # each evaluation: one greedy call (4 rows), one sampled (4 x 5)
    assert len(greedy) == 4 and len(sampled) == 20
    per_row = [sampled[i * 5 : (i + 1) * 5] for i in range(4)]
    correct = [sum(len(c) % 2 == 0 for c in row) for row in per_row]
    assert 0 < sum(correct) < 20  # the model's samples are neither all right nor all wrong
    for k in (1, 2, 5):
        want = statistics.fmean(1 - math.comb(5 - c, k) / math.comb(5, k) for c in correct)
        assert out[f"eval/pass@{k}"] == pytest.approx(want)
    assert out["eval/avg@5"] == pytest.approx(sum(correct) / 20) == out["eval/pass@1"]
    assert out["eval/avg_reward@5"] == pytest.approx(sum(correct) / 20)

    def vote(row):  # the most common stripped completion (first seen on a tie), right if its length is even
        texts = [c.strip() for c in row if c.strip()]
        top = max(Counter(texts).values())
        winner = next(t for t in texts if texts.count(t) == top)
        return len(row[[c.strip() for c in row].index(winner)]) % 2 == 0

    assert out["eval/maj@5"] == pytest.approx(statistics.fmean(vote(r) for r in per_row))
    assert out["eval/maj@1"] == pytest.approx(statistics.fmean(len(r[0]) % 2 == 0 for r in per_row))
    assert out["eval/accuracy"] == pytest.approx(statistics.fmean(len(c) % 2 == 0 for c in greedy))


def _rows(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))


def test_a_run_logs_them_and_trains_as_without_them(tmp_path, tiny_model_path):
    import tokenmill

    _rows(tmp_path)
    plain = tokenmill.train(_cfg(tmp_path, tiny_model_path))
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "run").rename(tmp_path / "plain")
    sampled = tokenmill.train(_cfg(tmp_path, tiny_model_path, eval_samples=4, eval_every=1))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/pass@1" not in plain["eval_after"] and plain["eval_after"]["eval/rows"] == 2
    evals = [r for r in rows if "eval/pass@4" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 2]  # before, every step, after
    assert {"eval/pass@1", "eval/maj@1", "eval/maj@4", "eval/avg@4", "eval/avg_reward@4"} <= evals[0].keys()
    assert all(r["eval/pass@1"] <= r["eval/pass@4"] for r in evals)
    # the evaluation samples from a stream of its own: training saw the very same samples and losses
    def trained(log):
        return [(r["reward/mean"], r["loss"], r["grad_norm"]) for r in log if "reward/mean" in r]

    assert trained(rows) == trained(logged) and len(trained(rows)) == 2
    assert sampled["eval_after"]["eval/accuracy"] == plain["eval_after"]["eval/accuracy"]


@pytest.mark.parametrize(("controller", "message"), [
    ({"eval_k": [2]}, "controller.eval_k: needs controller.eval_samples"),
    ({"eval_samples": 4, "eval_k": [1, 8]}, r"controller.eval_k: \[8\] outside 1..controller.eval_samples \(4\)"),
    ({"eval_samples": 4, "eval_k": [0]}, r"controller.eval_k: \[0\] outside"),
])
def test_bad_k_is_refused_naming_the_field(tmp_path, controller, message):
    from tokenmill.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, _cfg(tmp_path, "unused", **controller))
    assert RLConfig.model_validate(_cfg(tmp_path, "unused", eval_samples=8)).controller.eval_ks == [1, 8]
    assert RLConfig.model_validate(_cfg(tmp_path, "unused")).controller.eval_ks == []
