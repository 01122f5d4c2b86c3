"""A vision-language GRPO run with its rollouts in a producer thread (engine.placement: thread): the copy in
the thread is a `VisionEngine`, the prompts' pictures travel with the samples to the trainer, and at
max_staleness 0 the run is the colocated one, step for step and weight for weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tokenmill
from tokenmill.testing.docs import docs_block
from tokenmill.testing.rewards import chat_digit_share as digit_share
from tokenmill.types import ConfigError

PAGE = "tests/unit/controller/test_vision_async.py"  # the docs/vision.md block this test runs

pytest.importorskip("PIL")


def _config(model: str, out, **engine) -> dict:
    return {
        "model": {"path": model},
        "data": {"task": "shapes", "num_train": 32, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 3},
        "algorithm": {"skip_zero_advantage": False},
        "training": {"learning_rate": 1e-2, "seed": 3},
        "engine": {"threads": 1, **engine},
        "controller": {"steps": 3, "prompts_per_step": 2},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }


def _steps(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_a_thread_engine_samples_with_the_pictures_and_equals_colocated(tmp_path, tiny_vlm_path):
    torch.set_num_threads(1)
    colocated, thread = tmp_path / "colocated", tmp_path / "thread"
    tokenmill.train(_config(tiny_vlm_path, colocated), rewards=[digit_share])
    assert docs_block("vision.md", PAGE)["engine"] == {"placement": "thread"}
    tokenmill.train(_config(tiny_vlm_path, thread, **docs_block("vision.md", PAGE)["engine"]), rewards=[digit_share])
    a, b = _steps(colocated), _steps(thread)
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        # the same completions and rewards, step for step; the thread's kernels may sum a logprob in another
        # order than the trainer's thread (~5e-7 on the vision tower's tiny tensors), so the losses agree to that
        assert x["reward/mean"] == y["reward/mean"] and x["reward/std"] == y["reward/std"]
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6) and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    assert len({r["grad_norm"] for r in a}) > 1
    for row in b:
        # the trainer read each sample's pictures: without them its logprobs of the image-conditioned
        # completions would differ from the thread engine's by far more
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs"] <= 1e-5, row
        assert row["async/staleness_max"] == 0
    wa = load_file(str(colocated / "final" / "model.safetensors"))
    wb = load_file(str(thread / "final" / "model.safetensors"))
    start = load_file(str(Path(tiny_vlm_path) / "model.safetensors"))
    assert max((wa[k] - start[k]).abs().max().item() for k in wa) > 1e-3  # it trained
    # Adam's normalised step turns the thread's ~5e-7 rounding on near-zero gradients into up to ~7e-5 after 3
    # steps at lr 1e-2: far below what a step moves (> 1e-3 above), so this still catches a run that differs
    gap = max((wb[k] - wa[k]).abs().max().item() for k in wa)
    assert gap <= 2e-4, gap

def test_partial_rollouts_with_images_are_refused_naming_the_field(tmp_path, tiny_vlm_path):
    cfg = _config(tiny_vlm_path, tmp_path / "p", placement="thread")
    cfg["controller"].update(partial_rollouts=True, max_staleness=1)
    with pytest.raises(ConfigError, match=r"^controller.partial_rollouts: "):
        tokenmill.train(cfg, rewards=[digit_share])


def test_a_worker_process_samples_with_the_pictures_from_the_pushed_weights(tmp_path, tiny_vlm_path):
    torch.set_num_threads(1)
    out = tmp_path / "worker"
    tokenmill.train(_config(tiny_vlm_path, out, placement="worker"), rewards=[digit_share])
    rows = _steps(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and len({r["grad_norm"] for r in rows}) > 1
    for row in rows:
        # the worker's VisionEngine read each prompt's pixels, at the weights the trainer had just pushed
        # through shared memory (staleness 0): its logprobs are the trainer's
        assert row["mismatch/tokens"] > 0 and row["mismatch/max_abs"] <= 1e-5, row
        assert row["async/staleness_max"] == 0
