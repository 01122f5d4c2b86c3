"""A vision-language GRPO run whose engine is a spawned `tokenmill serve` (engine.placement: process): the prompts'
pictures travel as data-URL `image_url` parts, and the served logprobs are the trainer's."""

from __future__ import annotations

import json

import pytest
import torch

import tokenmill
from tokenmill.testing.docs import docs_block
from tokenmill.testing.rewards import chat_digit_share as digit_share

pytest.importorskip("PIL")


def test_a_vlm_run_samples_from_a_spawned_server(tmp_path, tiny_vlm_path):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    page = docs_block("vision.md", "tests/e2e/test_vlm_process_engine.py")
    result = tokenmill.train({
        "model": {"path": tiny_vlm_path},
        "data": {**page["data"], "num_train": 32, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 3},
        "training": {"learning_rate": 1e-2, "seed": 3},
        "engine": {**page["engine"], "timeout_s": 120},
        "controller": {"steps": 2, "prompts_per_step": 2},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }, rewards=[digit_share])
    assert result["last_metrics"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "mismatch/max_abs" in line]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # the image tokens had their pictures on the server: without them the logprobs would differ by far more
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs"] <= 1e-5, row
        assert row["probe/ok"] == 1.0 and row["probe/max_abs"] <= 1e-5  # the pushed weights reached the server
    assert (out / "server_0.log").is_file()
