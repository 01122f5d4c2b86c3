"""A vision-language GRPO run with `engine.placement: remote`: a `tokenmill serve` on loopback (started here, as
a user starts vLLM) gets each prompt as chat messages with `image_url` parts, and its logprobs are the
trainer's."""

from __future__ import annotations

import json

import pytest
import torch

import tokenmill
from tokenmill.testing.docs import docs_block
from tokenmill.testing.rewards import chat_digit_share as digit_share

pytest.importorskip("PIL")


def test_a_vlm_run_samples_from_a_remote_server_in_chat(tmp_path, tiny_vlm_path):
    from tokenmill.data.images import ImagePolicy
    from tokenmill.engines.server.app import create_app
    from tokenmill.engines.server.vision_serving import VisionServingEngine
    from tokenmill.serving import start_in_thread

    torch.set_num_threads(1)
    served = VisionServingEngine.from_pretrained(tiny_vlm_path, seed=0, policy=ImagePolicy(max_pixels=64 * 64))
    server, _ = start_in_thread(create_app(served, model_name="tiny-vlm"))
    out = tmp_path / "run"
    page = docs_block("vision.md", "tests/e2e/test_vlm_remote_engine.py")
    assert page["engine"]["placement"] == "remote"
    try:
        tokenmill.train({
            "model": {"path": tiny_vlm_path},
            "data": {**page["data"], "num_train": 32, "num_eval": 0},
            "generation": {"group_size": 4, "max_tokens": 3},
            "training": {"learning_rate": 1e-2, "seed": 3},
            "engine": {**page["engine"], "urls": [server.url], "timeout_s": 120},
            "controller": {"steps": 2, "prompts_per_step": 2},
            "tracking": {"output_dir": str(out), "console": "none"},
            "checkpoint": {"every": 0, "save_final": False},
        }, rewards=[digit_share])
    finally:
        server.stop()
        served.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "mismatch/max_abs" in line]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs"] <= 1e-5, row
        assert row["probe/ok"] == 1.0 and row["probe/max_abs"] <= 1e-5  # the pushed weights reached the server
    assert served.engine.version == 2  # both pushes landed


def test_a_multi_turn_vlm_run_is_refused_on_remote_servers(tmp_path, tiny_vlm_path):
    from tokenmill.types import ConfigError

    with pytest.raises(ConfigError, match=r"^engine.placement: remote servers take images in chat"):
        tokenmill.train({"model": {"path": tiny_vlm_path}, "data": {"task": "shapes", "num_train": 8, "num_eval": 0},
                         "env": {"name": "guess_number"},
                         "engine": {"placement": "remote", "urls": ["http://127.0.0.1:9"]},
                         "controller": {"steps": 1, "prompts_per_step": 2},
                         "tracking": {"output_dir": str(tmp_path / "t"), "console": "none"}})
