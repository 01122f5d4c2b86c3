"""A run whose `tokenmill estimate` peak exceeds its device's memory is refused before any weight loads, with
the estimate and the settings that would fit (`training.memory_check`; the device's memory given by
TOKENMILL_DEVICE_MEMORY_GIB). The model folder here holds a Qwen3-0.6B-sized config.json and no weights: a run
that got past the check would fail loading them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.config import RLConfig, load_config
from tokenmill.controller import build_run
from tokenmill.estimate.config import plan_from_config
from tokenmill.types import ConfigError

QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}


@pytest.fixture
def weightless(tiny_model_path, tmp_path) -> str:
    """The tiny model's tokenizer beside a 0.6B config.json, no weights."""
    folder = tmp_path / "qwen3-0.6b-shaped"
    folder.mkdir()
    for name in Path(tiny_model_path).iterdir():
        if name.name != "model.safetensors":
            shutil.copy(name, folder / name.name)
    config = json.loads((folder / "config.json").read_text()) | QWEN3_0_6B
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _cfg(path: str, out: Path, max_tokens: int = 1024, **training) -> RLConfig:
    return load_config(RLConfig, {
        "model": {"path": path, "device": "cpu"}, "data": {"task": "addition", "num_eval": 0},
        "generation": {"group_size": 8, "max_tokens": max_tokens}, "controller": {"steps": 1, "prompts_per_step": 8},
        "training": {"micro_batch_tokens": 8192} | training,
        "tracking": {"output_dir": str(out), "console": "none"}, "checkpoint": {"every": 0, "save_final": False},
    })


def _build(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        build_run(cfg).close()
    return str(err.value)


def test_a_run_over_the_device_memory_is_refused_with_the_settings_that_fit(weightless, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "6")
    message = _build(_cfg(weightless, tmp_path / "a"))
    assert message.startswith("training.memory_check: tokenmill estimate puts this run's peak at ")
    peak = float(message.split("peak at ")[1].split(" GiB")[0])
    assert peak > 6 and "has 6.0 GiB; nothing was loaded" in message
    # 64 rows x 1,280 tokens of fp32 key/value cache alone are 17.5 GiB: the rollout needs shorter completions
    fixes = message.split("Settings that bring it down, in order: ")[1]
    assert fixes.startswith("model.lora.rank: 16 (LoRA rank 16 on every linear layer, saves ")
    assert "training.optimizer_offload: true (optimizer state in CPU memory" in fixes
    assert "training.backend: fsdp2 over 64 GPUs (torchrun --nproc-per-node 64)" in fixes
    assert "generation.max_tokens: 512 (halve the completions to 512 tokens, saves" in fixes
    assert fixes.endswith(": then it fits). training.memory_check: false loads it anyway.")
    assert not (tmp_path / "a" / "config.yaml").exists()  # refused before the run wrote anything


def test_a_smaller_micro_batch_is_named_when_one_sequence_fits(weightless, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "24")
    cfg = _cfg(weightless, tmp_path / "b", max_tokens=256, micro_batch_tokens=65536)
    message = _build(cfg)
    suggested = int(message.split("It fits with training.micro_batch_tokens: ")[1].split(" ")[0])
    assert 0 < suggested < 65536
    ok = _cfg(weightless, tmp_path / "c", max_tokens=256, micro_batch_tokens=suggested)  # the suggestion gets past the check
    assert _build(ok).startswith("model.path: cannot load")


def test_a_run_that_fits_or_turns_the_check_off_goes_on_to_load(weightless, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "64")
    assert _build(_cfg(weightless, tmp_path / "d")).startswith("model.path: cannot load")
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "6")
    assert _build(_cfg(weightless, tmp_path / "e", memory_check=False)).startswith("model.path: cannot load")
    from tokenmill.training.model import check_memory

    check_memory(_cfg(weightless, tmp_path / "f", backend="fsdp2"), torch.device("cpu"))  # a rank: not checked


def test_the_runs_own_switches_shrink_the_estimate(weightless, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "6")
    fixed = _build(_cfg(weightless, tmp_path / "f", activation_checkpointing=True, optimizer_offload=True))
    plain = _build(_cfg(weightless, tmp_path / "g"))
    assert float(fixed.split("peak at ")[1].split(" GiB")[0]) < float(plain.split("peak at ")[1].split(" GiB")[0])
    assert "training.activation_checkpointing: true" not in fixed and "training.optimizer_offload" not in fixed
    plan, _ = plan_from_config({"model": {"path": weightless}, "data": {"task": "addition"},
                                "training": {"activation_checkpointing": True, "optimizer_offload": True}})
    assert plan.gradient_checkpointing and plan.optimizer_offload


def test_the_estimates_settings_are_named_as_a_run_sets_them():
    from tokenmill.estimate.fit import _run_setting

    assert _run_setting("estimate.gradient_checkpointing: true") == "training.activation_checkpointing: true"
    assert _run_setting("estimate.logprobs: chunked") == "training.chunked_logprobs: true"
    assert _run_setting("model.lora.rank: 16") == "model.lora.rank: 16"


def test_a_bad_memory_setting_names_the_variable(weightless, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DEVICE_MEMORY_GIB", "lots")
    assert _build(_cfg(weightless, tmp_path / "h")).startswith("TOKENMILL_DEVICE_MEMORY_GIB: expected the device")
