"""Measurements both children and the parent share: memory, machine load, step statistics, and the one
held-out evaluation (tokenmill's own `evaluate`, greedy) used for both trainers."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def peak_rss_mib() -> dict[str, float]:
    """Peak resident set size of this process (and of its largest reaped child), in MiB (Linux: KiB units)."""
    scale = 1024.0 if sys.platform != "darwin" else 1024.0 * 1024.0
    return {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / scale,
    }


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def cpu_busy_seconds() -> float:
    """CPU seconds all processes on the machine have been busy (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def load_meter() -> Iterator[dict[str, float]]:
    """Cores this process used, and cores *other* processes used, over a region (machine noise indicator)."""
    report: dict[str, float] = {}
    t0, busy0, own0 = time.perf_counter(), cpu_busy_seconds(), time.process_time()
    try:
        yield report
    finally:
        wall = max(time.perf_counter() - t0, 1e-9)
        own = time.process_time() - own0
        report["wall_s"] = wall
        report["own_cores"] = own / wall
        report["other_cores"] = max(0.0, (cpu_busy_seconds() - busy0 - own) / wall)


def step_stats(step_seconds: list[float]) -> dict[str, float]:
    """Median / min / max seconds per step with the first (warm-up) step excluded."""
    rest = step_seconds[1:] if len(step_seconds) > 1 else step_seconds
    return {
        "median": statistics.median(rest),
        "min": min(rest),
        "max": max(rest),
        "mean": statistics.fmean(rest),
        "first": step_seconds[0],
        "steps": len(step_seconds),
        "total": sum(step_seconds),
    }


def evaluate_model(model, tokenizer, eval_rows, max_rows: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy held-out accuracy with tokenmill's own evaluation (the one `tokenmill.train` runs)."""
    from tokenmill.controller.evaluate import evaluate
    from tokenmill.data.tasks import addition_reward
    from tokenmill.engines import HFEngine
    from tokenmill.rewards import FunctionReward, RewardSet
    from tokenmill.rollout import Generator
    from tokenmill.types import SamplingParams

    rewards = RewardSet([FunctionReward(addition_reward, isolation="thread")])
    try:
        generator = Generator(
            HFEngine(model, tokenizer), tokenizer, rewards, SamplingParams(max_tokens=max_new_tokens)
        )
        start = time.perf_counter()
        out = evaluate(generator, eval_rows, max_rows)
        out["eval/seconds"] = time.perf_counter() - start
        return out
    finally:
        rewards.close()


def train_reward_summary(rewards: list[float], k: int = 20) -> dict[str, float]:
    rewards = [r for r in rewards if r is not None]
    if not rewards:
        return {}
    k = min(k, len(rewards))
    return {
        "first_k_mean": statistics.fmean(rewards[:k]),
        "last_k_mean": statistics.fmean(rewards[-k:]),
        "k": k,
    }

