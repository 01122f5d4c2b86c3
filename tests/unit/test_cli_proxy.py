"""`tokenmill train` in proxy mode as a user runs it: the CLI starts the endpoint and the example agent (a plain
OpenAI-SDK program in a subprocess), trains on its reported episodes, and stops when it has its steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("openai")
AGENT = Path(__file__).parents[2] / "examples" / "openai_agent" / "agent.py"


def test_tokenmill_train_with_a_proxy_section_trains_on_the_sdk_agents_episodes(tiny_model_path, tmp_path):
    cfg = {
        "model": {"path": tiny_model_path},
        "data": {"task": "addition", "num_train": 50, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "controller": {"steps": 3, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "plain"},
        "checkpoint": {"every": 0, "save_final": False},
        "proxy": {"port": 0, "wait_timeout_s": 60, "agent_command": [
            sys.executable, str(AGENT), "--url", "{url}", "--games", "6", "--group-size", "4", "--parallel", "8"]},
    }
    (tmp_path / "proxy.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "train", str(tmp_path / "proxy.yaml")],
                          check=False, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "/proxy/<episode id>/v1" in done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["reward/unscored"] == 0
        assert 0 <= r["proxy/version_lag_max"] <= 2
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"][0] == {"role": "system", "content": "guess"} for s in samples)


def test_a_proxy_config_that_cannot_work_is_refused_before_loading(tmp_path):
    cfg = {"model": {"path": "nowhere"}, "data": {"task": "addition"}, "proxy": {},
           "engine": {"placement": "thread"}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "train", str(tmp_path / "bad.yaml")],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "proxy: proxy mode serves the policy itself" in done.stderr and "engine.placement" in done.stderr
