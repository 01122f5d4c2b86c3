"""mismatch/* against hand-computed values, then on real runs of the quickstart's GRPO config on the tiny model:
~0 for the in-process fp32 engine, clearly up when the engine samples at another temperature."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill.health.mismatch import add_sums, finish, mismatch_stats, mismatch_sums
from tokenmill.recipes import grpo

# two rows; row 0: 3 trained tokens, row 1: 1 trained token then padding
ENGINE = [[0.0, math.log(0.5), math.log(0.2), math.log(0.9)], [0.0, math.log(0.4), 0.0, 0.0]]
TRAINER = [[0.0, math.log(0.26), math.log(0.5), math.log(0.9)], [0.0, math.log(0.4), -7.0, 0.0]]
MASK = [[0, 1, 1, 1], [0, 1, 0, 0]]


def test_metrics_by_hand():
    got = mismatch_stats(torch.tensor(ENGINE), torch.tensor(TRAINER), torch.tensor(MASK))
    # r = trainer / engine on the 4 trained tokens: 0.52, 2.5, 1, 1; d = log r
    d = [math.log(0.52), math.log(2.5), 0.0, 0.0]
    assert got["mismatch/mean_abs"] == pytest.approx(sum(abs(x) for x in d) / 4, rel=1e-6)
    assert got["mismatch/max_abs"] == pytest.approx(math.log(2.5), rel=1e-6)
    # k3 = r - 1 - log r: (0.52 - 1 - log 0.52) + (2.5 - 1 - log 2.5)
    assert got["mismatch/kl"] == pytest.approx((-0.48 - math.log(0.52) + 1.5 - math.log(2.5)) / 4, rel=1e-5)
    assert got["mismatch/out_of_range_frac"] == pytest.approx(1 / 4)  # 2.5 > 2; 0.52 is inside [0.5, 2]
    assert got["mismatch/tokens"] == 4


def test_sums_add_up_like_one_batch():
    e, t, m = torch.tensor(ENGINE), torch.tensor(TRAINER), torch.tensor(MASK)
    whole = mismatch_stats(e, t, m)
    parts = add_sums(mismatch_sums(e[:1], t[:1], m[:1]), mismatch_sums(e[1:], t[1:], m[1:]))
    assert finish(parts) == pytest.approx(whole)
    assert mismatch_stats(e, t, torch.zeros_like(m))["mismatch/mean_abs"] == 0.0


def _steps(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if "mismatch/mean_abs" in line]


def test_in_process_fp32_engine_matches_the_trainer_on_the_quickstart(tiny_model_path, tmp_path):
    grpo(tiny_model_path, tmp_path, steps=3, prompts_per_step=4, group_size=4, num_eval=4, eval_every=0,
         console="none", say=lambda _: None)
    rows = _steps(tmp_path)
    assert len(rows) == 3
    for row in rows:
        assert row["mismatch/mean_abs"] <= 1e-5 and row["mismatch/max_abs"] <= 1e-4
        assert row["mismatch/out_of_range_frac"] == 0.0 and abs(row["mismatch/kl"]) <= 1e-8
        assert row["mismatch/temperature"] == 1.0 and row["mismatch/tokens"] > 0
        assert row["probe/ok"] == 1.0 and row["probe/max_abs"] <= 1e-5  # the shared module: trivially


def test_an_engine_at_another_temperature_raises_the_metrics(tiny_model_path, tmp_path):
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl
    from tokenmill.testing.health import shift_temperature

    cfg = load_config(RLConfig, {
        "model": {"path": tiny_model_path}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 6, "temperature": 1.0},
        "controller": {"steps": 2, "prompts_per_step": 4},
        "tracking": {"output_dir": str(tmp_path), "console": "none"}, "checkpoint": {"every": 0, "save_final": False},
    })
    run = build_run(cfg)
    try:
        assert shift_temperature(run, 1.5).temperature == 1.5
        run_rl(run)
    finally:
        run.close()
    rows = _steps(tmp_path)
    assert len(rows) == 2
    for row in rows:
        # the random tiny model's next-token distributions are flat, so a temperature changes them little:
        # still 1000x the fp32 engine's gap
        assert row["mismatch/mean_abs"] > 1e-2 and row["mismatch/kl"] > 1e-4
        assert row["mismatch/temperature"] == 1.0  # what the trainer assumed
