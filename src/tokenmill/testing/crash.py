"""Kill-and-resume runs of `tokenmill train` in real subprocesses, for crash tests and the determinism
benchmark: SIGKILL at a chosen point (after a checkpoint, mid-checkpoint write, before or during the
final export), resume, and compare the final weights with an uninterrupted run. `run_and_signal` sends a run
SIGTERM, SIGINT or SIGUSR1 (`checkpoint.preempt`) instead, for the preemption tests and benchmarks/chaos.py.

Exact points use the writer's hold points (`TOKENMILL_TEST_HOLD`, see `tokenmill.checkpoint.atomic`): the
trainer announces on stderr that it is holding there and sleeps until it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

REWARD = '''
def digit_share(prompts, completions, **_):
    """A dense reward (share of digits), so a random-init model gets non-zero advantages."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]
'''

# where a run of `write_config`'s 4 steps is killed: "after-checkpoint@K" (SIGKILL as soon as step K's
# checkpoint is in place: the kill lands in step K+1), or a hold point of the checkpoint writer (the
# weights written but not the trainer state; the final checkpoint complete but not renamed into place) or
# of the final export (not begun; written but not renamed into place)
KILL_POINTS = ("after-checkpoint@1", "checkpoint-model@2", "checkpoint-rename@4", "export", "export-rename")


def write_config(folder: Path, model: str, *, steps: int = 4, deterministic: bool = True,
                 overrides: dict[str, dict] | None = None) -> Path:
    """A tiny GRPO run (checkpoint every step, process-isolated reward workers) writing to folder/run;
    `overrides` are merged into its sections."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text(REWARD)
    config = {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 200, "num_eval": 0},
        "generation": {"group_size": 4, "max_tokens": 4},
        "rewards": [{"function": f"{folder / 'rewards.py'}:digit_share", "isolation": "process"}],
        "algorithm": {"ppo_epochs": 2, "mini_batches": 2},
        "training": {"learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "seed": 3,
                     "deterministic": deterministic},
        "controller": {"steps": steps, "prompts_per_step": 4},
        "tracking": {"output_dir": str(folder / "run"), "console": "none"},
        "checkpoint": {"every": 1, "keep_last": 2, "save_final": True},
    }
    for section, values in (overrides or {}).items():
        config[section] = {**config.get(section, {}), **values}
    path = folder / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _command(config: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "train", str(config), "--checkpoint.resume",
            "true" if resume else "false"]


def run_to_end(config: Path, *, resume: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_TEST_HOLD"}
    return subprocess.run(_command(config, resume), capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


@dataclass
class Killed:
    point: str
    children: list[int]  # the trainer's descendants at the moment of the kill
    commands: dict[int, str]  # their command lines
    left_after_s: list[int]  # those still alive `orphan_wait_s` later
    seconds: float


def run_and_kill(config: Path, point: str, *, timeout: float = 600, orphan_wait_s: float = 5.0) -> Killed:
    """Start a fresh run and SIGKILL it at `point` (one of KILL_POINTS' forms)."""
    out = Path(json.loads(config.read_text())["tracking"]["output_dir"])
    env = dict(os.environ)
    after = point.startswith("after-checkpoint@")
    if not after:
        env["TOKENMILL_TEST_HOLD"] = point
    stderr_path = config.parent / f"stderr-{point}.txt"
    start = time.monotonic()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(_command(config, resume=False), stdout=subprocess.DEVNULL, stderr=stderr,
                                env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"run exited ({proc.returncode}) before {point}: "
                                   f"{stderr_path.read_text()[-2000:]}")
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"run did not reach {point} in {timeout:.0f}s")
            if after:
                if (out / "checkpoints" / f"step_{int(point.split('@')[1]):08d}").is_dir():
                    break
            elif f"holding at {point}\n" in stderr_path.read_text():
                break
            time.sleep(0.02)
        children = descendants(proc.pid)
        commands = {pid: _cmdline(pid) for pid in children}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic() + orphan_wait_s
    while time.monotonic() < end and any(alive(p) for p in children):
        time.sleep(0.05)
    return Killed(point, children, commands, [p for p in children if alive(p)], time.monotonic() - start)


@dataclass
class Signalled:
    """How a run ended that was sent `signals` (`run_and_signal`)."""

    returncode: int
    stderr: str
    steps_logged: int  # metrics rows of this process when the first signal was sent
    steps_done: int  # and when it exited
    exit_s: float  # from the last signal to the exit
    seconds: float  # the whole run


def run_and_signal(config: Path, signals: list[int], *, after_rows: int = 1, hold: str | None = None,
                   delay_s: float = 0.0, gap_s: float = 0.5, resume: bool = False, group: bool = False,
                   command: str = "train", timeout: float = 120) -> Signalled:
    """Start `tokenmill train config` and send it `signals` one after another (`gap_s` apart) `delay_s` after its
    metrics file has `after_rows` rows of this process (or, with `hold`, once it holds at that point of the
    checkpoint writer); wait for it to exit. `group`: to its whole process group, as a terminal's Ctrl-C (the run gets a
    session of its own), else to the trainer alone, as `docker stop` and Kubernetes do. `command`: `train`, or an
    offline one (`sft`, `preference`: their config's `output_dir` holds the metrics)."""
    settings = json.loads(config.read_text())
    out = Path(settings["tracking"]["output_dir"] if command == "train" else settings["output_dir"])
    metrics = out / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_TEST_HOLD"} | ({"TOKENMILL_TEST_HOLD": hold} if hold else {})
    stderr_path = config.parent / f"stderr-{os.getpid()}-{time.monotonic_ns()}.txt"
    start = time.monotonic()
    with open(stderr_path, "w") as stderr:
        args = _command(config, resume) if command == "train" else [sys.executable, "-m", "tokenmill.cli", command,
                                                                    str(config)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)
    try:
        while (f"holding at {hold}\n" not in stderr_path.read_text() if hold else
               (len(metrics.read_text().splitlines()) if metrics.exists() else 0) - before < after_rows):
            if proc.poll() is not None:
                raise RuntimeError(f"run exited ({proc.returncode}) before the signal: {stderr_path.read_text()[-2000:]}")
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"run did not reach the signal point in {timeout:.0f}s")
            time.sleep(0.01)
        time.sleep(delay_s)
        rows = len(metrics.read_text().splitlines()) - before if metrics.exists() else 0
        for i, sig in enumerate(signals):
            if i:
                time.sleep(gap_s)
            os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
            sent = time.monotonic()
        proc.wait(timeout=timeout)
        exit_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = len(metrics.read_text().splitlines()) - before if metrics.exists() else 0
    return Signalled(proc.returncode, stderr_path.read_text(), rows, done, exit_s, time.monotonic() - start)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
