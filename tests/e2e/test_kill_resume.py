"""kill -9 of `tokenmill train` at chosen points, then resume: no process of the killed run is left, `final/`
is written, and with `training.deterministic` the final weights equal an uninterrupted run's bit for bit.

Real subprocesses and SIGKILL (`tokenmill.testing.crash`); the exact points are the checkpoint writer's hold
points. CI kills once, mid-checkpoint (~45 s); the slow test kills at all five points (~3.5 min on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.testing import build_tiny_model
from tokenmill.testing.crash import KILL_POINTS, final_weights, run_and_kill, run_to_end, write_config


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The tiny model and the final weights of an uninterrupted deterministic run of it."""
    root = tmp_path_factory.mktemp("kill")
    model = build_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    config = write_config(root / "uninterrupted", model)
    done = run_to_end(config)
    assert done.returncode == 0, done.stderr[-3000:]
    return model, final_weights(root / "uninterrupted" / "run")


def _kill_and_resume(tmp_path: Path, model: str, point: str) -> dict[str, torch.Tensor]:
    config = write_config(tmp_path / point.replace("@", "-"), model)
    out = Path(json.loads(config.read_text())["tracking"]["output_dir"])
    killed = run_and_kill(config, point)
    assert killed.children, "the run had started its reward workers"
    assert killed.left_after_s == [], f"{point}: processes outlived the killed trainer: {killed.left_after_s}"
    assert not (out / "final").exists()
    done = run_to_end(config, resume=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "final" / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    return final_weights(out)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_kill_mid_checkpoint_then_resume_is_exact(tmp_path, baseline):
    model, expected = baseline
    _assert_equal(_kill_and_resume(tmp_path, model, "checkpoint-model@2"), expected)


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_kill_anywhere_then_resume_is_exact(tmp_path, baseline, point):
    model, expected = baseline
    _assert_equal(_kill_and_resume(tmp_path, model, point), expected)


# a run big enough that torch's default CPU kernels are not bit-reproducible on a 2-core machine: two
# uninterrupted runs of it without training.deterministic differ by ~1.2e-7 (benchmarks/determinism.py)
LARGER = {"controller": {"prompts_per_step": 16}, "generation": {"group_size": 8, "max_tokens": 16}}


@pytest.mark.slow
def test_deterministic_mode_makes_a_larger_run_exact(tmp_path):
    """~1 min on 2 cores."""
    model = build_tiny_model(tmp_path / "model")  # the quickstart's width: 128, 2 layers
    config = write_config(tmp_path / "uninterrupted", model, overrides=LARGER)
    done = run_to_end(config)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = final_weights(tmp_path / "uninterrupted" / "run")
    config = write_config(tmp_path / "killed", model, overrides=LARGER)
    killed = run_and_kill(config, "checkpoint-model@2")
    assert killed.children and killed.left_after_s == []
    done = run_to_end(config, resume=True)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_equal(final_weights(tmp_path / "killed" / "run"), expected)


@pytest.mark.slow
def test_spawned_servers_die_with_a_killed_trainer(tmp_path, baseline):
    """engine.placement process: the `tokenmill serve` processes go with the trainer (~40 s)."""
    model, _ = baseline
    config = write_config(tmp_path / "process", model, deterministic=False,
                          overrides={"engine": {"placement": "process"}, "controller": {"max_staleness": 1}})
    killed = run_and_kill(config, "after-checkpoint@1")
    servers = [p for p, command in killed.commands.items() if "tokenmill.cli serve" in command]
    assert len(servers) == 1 and len(killed.children) >= 2  # the server, and reward workers
    assert killed.left_after_s == []
