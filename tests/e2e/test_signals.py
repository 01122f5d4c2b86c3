"""Signals to a real `tokenmill train` (tiny model, CPU): SIGTERM and Ctrl-C finish the step, save a checkpoint,
print one line and exit with status 75, and a resume ends bit for bit where an uninterrupted run does; a second
Ctrl-C exits at once; a save that overruns `checkpoint.preempt_timeout_s` exits 143 without a half checkpoint;
SIGUSR1 saves and the run goes on. Real subprocesses and signals (`tokenmill.testing.crash.run_and_signal`).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenmill.checkpoint.preempt import EXIT_PREEMPTED
from tokenmill.testing import build_tiny_model
from tokenmill.testing.crash import final_weights, run_and_signal, run_to_end, write_config

STEPS = 8
ONLY_AT_THE_END = {"checkpoint": {"every": 0}}  # a signal's checkpoint is the only one before the end


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The tiny model and the final weights of an uninterrupted deterministic run of it (~7 s)."""
    root = tmp_path_factory.mktemp("preempt")
    model = build_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    done = run_to_end(write_config(root / "uninterrupted", model, steps=STEPS, overrides=ONLY_AT_THE_END))
    assert done.returncode == 0, done.stderr[-3000:]
    return model, final_weights(root / "uninterrupted" / "run")


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").is_dir() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_says_so_exits_75_and_the_resume_is_exact(tmp_path, baseline, sig):
    """SIGTERM to the trainer alone (docker stop, Kubernetes); SIGINT to the process group (a terminal's Ctrl-C,
    which reaches the reward workers too). ~15 s each."""
    model, expected = baseline
    config = write_config(tmp_path / "job", model, steps=STEPS, overrides=ONLY_AT_THE_END)
    out = tmp_path / "job" / "run"
    got = run_and_signal(config, [sig], after_rows=2, group=sig == signal.SIGINT)
    assert got.returncode == EXIT_PREEMPTED, got.stderr[-3000:]
    [line] = [x for x in got.stderr.splitlines() if x.startswith(f"tokenmill: stopped by {sig.name}")]
    step = int(re.search(r"after step (\d+) of 8", line).group(1))
    assert got.steps_logged <= step < STEPS  # the step running at the signal finished, then was saved
    assert f"checkpoint saved to {out / 'checkpoints' / f'step_{step:08d}'}" in line
    assert "--checkpoint.resume true" in line and "(exit status 75)" in line
    assert _checkpoints(out) == [f"step_{step:08d}"]  # complete, and nothing half-written beside it
    assert got.exit_s < 10
    assert not (out / "final").exists()
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    [saved] = [e for e in events if e.get("event") == "preempt"]
    assert saved["signal"] == sig.name and saved["step"] == step and saved["stop"] is True
    done = run_to_end(config, resume=True)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_equal(final_weights(out), expected)


def test_a_second_ctrl_c_exits_at_once_without_a_checkpoint(tmp_path, baseline):
    """The first Ctrl-C arrives while step 2's checkpoint is being written (held there), the second one 0.5 s
    later: the run exits 130 at once and the save in progress leaves no folder behind (~6 s)."""
    model, _ = baseline
    config = write_config(tmp_path / "job", model, steps=STEPS, overrides={"checkpoint": {"every": 2}})
    out = tmp_path / "job" / "run"
    got = run_and_signal(config, [signal.SIGINT, signal.SIGINT], hold="checkpoint-model@2", group=True)
    assert got.returncode == 130, got.stderr[-3000:]
    assert "Ctrl-C again to exit at once" in got.stderr and "interrupted again: exiting now" in got.stderr
    assert got.exit_s < 3.0, f"the second Ctrl-C took {got.exit_s:.2f} s"
    assert _checkpoints(out) == []  # neither step 2 nor its temporary folder


def test_a_save_that_overruns_the_bound_exits_143_and_leaves_no_half_checkpoint(tmp_path, baseline):
    """SIGTERM while step 2's checkpoint is stuck half-written, with checkpoint.preempt_timeout_s 1: the process
    exits 143 about a second later, its temporary folder deleted; step 1's checkpoint is intact (~6 s)."""
    model, _ = baseline
    config = write_config(tmp_path / "job", model, steps=STEPS,
                          overrides={"checkpoint": {"every": 1, "preempt_timeout_s": 1}})
    out = tmp_path / "job" / "run"
    got = run_and_signal(config, [signal.SIGTERM], hold="checkpoint-model@2")
    assert got.returncode == 128 + signal.SIGTERM, got.stderr[-3000:]
    assert "not saved within the bound (1 s; checkpoint.preempt_timeout_s)" in got.stderr and "deleted the half-written .tmp-step_00000002" in got.stderr
    assert 0.9 < got.exit_s < 5
    assert _checkpoints(out) == ["step_00000001"]


def test_sigusr1_saves_a_checkpoint_and_the_run_goes_on(tmp_path, baseline):
    """One SIGUSR1 after step 2: a checkpoint appears, the run ends normally, and the extra save changed nothing
    (final weights equal the uninterrupted run's) (~8 s)."""
    model, expected = baseline
    config = write_config(tmp_path / "job", model, steps=STEPS,
                          overrides={"checkpoint": {"every": 0, "keep_last": 3}})
    out = tmp_path / "job" / "run"
    got = run_and_signal(config, [signal.SIGUSR1], after_rows=2)
    assert got.returncode == 0, got.stderr[-3000:]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    [saved] = [e for e in events if e.get("event") == "preempt"]
    assert saved["signal"] == "SIGUSR1" and saved["stop"] is False and 2 <= saved["step"] < STEPS
    assert _checkpoints(out) == [f"step_{saved['step']:08d}", f"step_{STEPS:08d}"]
    _assert_equal(final_weights(out), expected)


def test_sigterm_stops_an_sft_run_and_writes_the_model_so_far(tmp_path, baseline):
    """`tokenmill sft` (the offline loop, no checkpoints): the step finishes, the model trained so far is written
    to output_dir, one line says so, exit status 75 (~8 s)."""
    model, _ = baseline
    out = tmp_path / "sft"
    config = tmp_path / "sft.json"
    config.write_text(json.dumps({"model": {"path": model}, "data": {"task": "addition", "num_train": 200},
                                  "output_dir": str(out), "steps": 500, "batch_size": 8}))
    got = run_and_signal(config, [signal.SIGTERM], after_rows=3, command="sft")
    assert got.returncode == EXIT_PREEMPTED, got.stderr[-3000:]
    [line] = [x for x in got.stderr.splitlines() if x.startswith("tokenmill: sft stopped by SIGTERM")]
    step = int(re.search(r"after step (\d+) of 500", line).group(1))
    assert got.steps_logged <= step == got.steps_done < 500
    assert f"the model as trained so far written to {out}" in line
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def _torchrun(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tokenmill",
            "train", str(config), *args]


@pytest.mark.slow
def test_torchrun_sigterm_every_rank_saves_and_the_resume_is_exact(tmp_path):
    """SIGTERM to the torchrun launcher (what Slurm or Kubernetes signal): it forwards it to both FSDP2 ranks,
    which agree on the step, save one checkpoint together (sharded optimiser state, rank 0 writing the folder) and
    exit 75; a torchrun resume then ends bit for bit where an uninterrupted torchrun run does (~2-3 min)."""
    model = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    overrides = {"training": {"backend": "fsdp2"}, "checkpoint": {"every": 0}}
    whole = write_config(tmp_path / "whole", model, steps=6, overrides=overrides)
    done = subprocess.run(_torchrun(whole), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config = write_config(tmp_path / "split", model, steps=6, overrides=overrides)
    out = tmp_path / "split" / "run"
    log = tmp_path / "torchrun.txt"
    with open(log, "w") as sink:
        proc = subprocess.Popen(_torchrun(config), stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    text = log.read_text()
    stopped = re.findall(r"tokenmill: stopped by SIGTERM after step (\d+) of 6", text)
    assert len(stopped) == 2 and len(set(stopped)) == 1, text[-3000:]  # both ranks, the same step
    step = int(stopped[0])
    assert re.search(r"exitcode\s*:\s*75", text) or "exit status 75" in text, text[-3000:]
    assert _checkpoints(out) == ["shards", f"step_{step:08d}"]
    done = subprocess.run(_torchrun(config, "--checkpoint.resume", "true"), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_equal(final_weights(out), final_weights(tmp_path / "whole" / "run"))
