"""`torchrun --standalone --nproc_per_node 2 -m tokenmill train cfg.yaml` with `training.backend: fsdp2` on CPU
(gloo): rank 0 alone logs and exports, both ranks' rollouts are trained on, the export equals the sharded
training state, and every socket the job listens on is on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.testing import build_tiny_model
from tokenmill.testing.crash import descendants, write_config


def _listening(pids: list[int]) -> set[str]:
    """'address:port' of every listening TCP socket owned by `pids` (from /proc, no extra packages)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        except OSError:
            continue  # the process ended meanwhile
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr, port = local.split(":")
            if width == 8:
                ip = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:  # only the two addresses that matter here are spelled out
                ip = {"0" * 24 + "01000000": "::1", "0" * 32: "::"}.get(addr, addr)
            found.add(f"{ip}:{int(port, 16)}")
    return found


def _torchrun(config: Path, *args: str, timeout: float = 300, nproc: int = 2
              ) -> tuple[subprocess.CompletedProcess, set[str], set[str]]:
    """Run the job to its end; return it and the listening sockets seen while it ran: torchrun's own (the
    launcher's rendezvous store) and those of the ranks and their workers."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "tokenmill", "train", str(config), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher: set[str] = set()
    ranks: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun did not finish in {timeout} s")
            launcher |= _listening([proc.pid])
            ranks |= _listening(descendants(proc.pid))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    return subprocess.CompletedProcess(command, proc.returncode, out, ""), launcher, ranks


def test_torchrun_two_ranks_train_and_rank0_exports(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    config = write_config(tmp_path / "job", model, steps=3, deterministic=False,
                          overrides={"training": {"backend": "fsdp2"}, "checkpoint": {"every": 2},
                                     "algorithm": {"skip_zero_advantage": False}})
    done, launcher, ranks = _torchrun(config)
    assert done.returncode == 0, done.stdout[-3000:]
    # the ranks (gloo, reward workers) listen on loopback only; torchrun's rendezvous store (a TCPStore, which
    # has no bind address) listens on every interface on a random port: see docs/scale-out.md
    assert ranks and all(s.startswith(("127.0.0.1:", "::1:")) for s in ranks), ranks
    assert launcher and all(s.startswith(("127.0.0.1:", "::1:", "::", "0.0.0.0:")) for s in launcher), launcher
    run = tmp_path / "job" / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: no rank's rows twice
    # 4 prompts x 4 samples, the two halves sampled by the two ranks, all trained on in each of the 2 epochs
    # (2 epochs x 2 mini-batches = 4 optimiser steps)
    assert [(r["train/sequences_trained"], r["train/optimizer_steps"]) for r in rows] == [(32, 4)] * 3
    # sharded checkpoints beside the usual ones; every rank wrote its part
    shards = run / "checkpoints" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == ["optim-step-00000008", "optim-step-00000012"]
    assert {p.name for p in (shards / "optim-step-00000012").iterdir()} == {".metadata", "__0_0.distcp",
                                                                             "__1_0.distcp"}
    trainer = torch.load(run / "checkpoints" / "step_00000003" / "trainer.pt", weights_only=True)["trainer"]
    assert trainer["shards"] == "optim-step-00000012" and trainer["world_size"] == 2
    # the export (rank 0's full copy, refreshed from the shards after each update) is the sharded state itself
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(shards / "optim-step-00000012", tmp_path / "full.pt")
    trained = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    final = load_file(str(run / "final" / "model.safetensors"))
    assert final.keys() == trained.keys()
    assert all(torch.equal(final[k], trained[k]) for k in final)
    start = load_file(str(Path(model) / "model.safetensors"))
    assert any(not torch.equal(final[k], start[k]) for k in final)  # it trained


@pytest.mark.slow  # two torchrun jobs: about 100 s on 2 cores (tests/unit/training/test_dist.py runs in CI)
def test_torchrun_two_ranks_draw_and_train_what_one_process_does(tmp_path):
    """The global batch does not depend on the rank count: one process (torchrun, 1 rank) and 2 gloo ranks
    sample the same completions for the same prompts, with the same rewards and advantages, and end with the
    same weights up to the order of float sums (2 ranks sum each gradient in another order)."""
    model = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    out = {}
    for nproc in (1, 2):
        config = write_config(tmp_path / f"ranks{nproc}", model, steps=3, overrides={
            "training": {"backend": "fsdp2"}, "checkpoint": {"every": 0},
            "tracking": {"log_samples": 16}, "algorithm": {"skip_zero_advantage": False}})
        done, _, _ = _torchrun(config, nproc=nproc)
        assert done.returncode == 0, done.stdout[-3000:]
        out[nproc] = tmp_path / f"ranks{nproc}" / "run"

    def samples(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]

    one, two = samples(out[1]), samples(out[2])
    assert len(one) == 3 * 16  # every sample of the 3 steps (4 prompts x 4)
    keys = ("step", "prompt", "completion", "reward", "stop")
    assert [tuple(r.get(k) for k in keys) for r in two] == [tuple(r.get(k) for k in keys) for r in one]
    assert [r["advantage"] for r in two] == pytest.approx([r["advantage"] for r in one], abs=1e-9)
    assert len({r["completion"] for r in one}) > 8  # the samples differ from each other
    final1 = load_file(str(out[1] / "final" / "model.safetensors"))
    final2 = load_file(str(out[2] / "final" / "model.safetensors"))
    start = load_file(str(Path(model) / "model.safetensors"))
    assert max((final1[k] - start[k]).abs().max().item() for k in final1) > 1e-4  # it trained
    for name, tensor in final1.items():  # 3 steps x 4 AdamW steps; the sum order alone differs
        torch.testing.assert_close(final2[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_torchrun_stop_and_resume_equals_uninterrupted(tmp_path):
    """2 steps, stop (controller.max_steps_per_run), resume to 4: the export equals a 4-step run's, bit for bit
    (sharded optimiser state, every rank's sampling RNG, data position)."""
    model = build_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, seed=0, tie_word_embeddings=False)
    finals = []
    for name, legs in (("whole", [[]]), ("split", [["--controller.max_steps_per_run", "2"],
                                                   ["--checkpoint.resume", "true"]])):
        config = write_config(tmp_path / name, model, steps=4, overrides={"training": {"backend": "fsdp2"}})
        for leg in legs:
            done, _, _ = _torchrun(config, *leg)
            assert done.returncode == 0, done.stdout[-3000:]
        finals.append(load_file(str(tmp_path / name / "run" / "final" / "model.safetensors")))
    whole, split = finals
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)


@pytest.mark.slow
def test_torchrun_fsdp2_grpo_learns_addition(warm, tmp_path):
    """The quickstart's GRPO (see test_grpo_learns) on 2 FSDP2 ranks: held-out greedy accuracy up 10 points."""
    config = {
        "model": {"path": str(warm)},
        "data": {"task": "addition", "num_eval": 500},
        "generation": {"group_size": 8, "max_tokens": 6, "temperature": 1.0},
        "algorithm": {"advantage": "grpo"},
        "training": {"learning_rate": 5e-5, "seed": 0, "backend": "fsdp2"},
        "controller": {"steps": 150, "prompts_per_step": 16, "eval_every": 0, "eval_max_rows": 500},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    done, _, _ = _torchrun(path, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    print(f"held-out greedy accuracy {evals[0]:.3f} -> {evals[-1]:.3f}")
    assert len(evals) == 2 and evals[-1] - evals[0] >= 0.10, evals
