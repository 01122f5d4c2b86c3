"""A vision-language LoRA run resumes exactly: 2 steps + stop + resume 2 steps == 4 steps, on the shapes task."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import tokenmill

pytest.importorskip("PIL")


def digit_share(prompts, completions, **_):
    """A dense reward, so a random-init model gets non-zero advantages (a chat prompt's completions are
    assistant messages, as TRL passes them)."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def _config(model: str, out: str, **controller) -> dict:
    return {
        "model": {"path": model, "lora": {"rank": 4}},
        "data": {"task": "shapes", "num_train": 64, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 3},
        "training": {"learning_rate": 1e-2, "seed": 3},
        "controller": {"steps": 4, "prompts_per_step": 4, **controller},
        "tracking": {"output_dir": out, "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }


def _last_checkpoint(out) -> dict[str, torch.Tensor]:
    return load_file(str(max((out / "checkpoints").glob("step_*")) / "model.safetensors"))


def test_a_vlm_lora_run_resumes_exactly(tmp_path, tiny_vlm_path):
    torch.set_num_threads(1)
    full, split = tmp_path / "full", tmp_path / "split"
    tokenmill.train(_config(tiny_vlm_path, str(full)), rewards=[digit_share])
    tokenmill.train(_config(tiny_vlm_path, str(split), max_steps_per_run=2), rewards=[digit_share])
    second = tokenmill.train(_config(tiny_vlm_path, str(split)), rewards=[digit_share], checkpoint__resume=True)
    assert second["resumed_from"] == 2
    a, b = _last_checkpoint(full), _last_checkpoint(split)
    assert a.keys() == b.keys() and any("lora_" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(a[k].abs().sum()) > 0 for k in a if "lora_B" in k)  # the adapters moved from zero
