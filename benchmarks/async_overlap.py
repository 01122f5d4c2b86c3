"""Synchronous vs asynchronous GRPO on this machine: same settings, same model, interleaved pairs.

    python benchmarks/async_overlap.py                      # the engine in a `tokenmill serve` process (~1 min)
    python benchmarks/async_overlap.py --placement thread   # an engine copy driven by a producer thread

The sync run alternates generation (generate + reward) and training (train + sync) on one torch thread; its
per-step times give `gen` and `train`. The async run (`controller.max_staleness`, default 1) puts the engine
elsewhere with one torch thread for generation and one for training, so the two overlap. Printed per pair
and for the median pair: each run's step time, the per-stage busy fractions, overlap efficiency =
max(gen, train) / async step time (1.0 = perfect overlap; goal >= 0.85) and the speedup over sync, with the
machine's load average (other processes on a shared 2-core machine skew single runs, hence the pairs). The
first `--warmup` steps of each run are not counted. Results: benchmarks/results/async_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tokenmill
from tokenmill.testing.quickstart import MODEL
from tokenmill.testing.tiny import build_tiny_model

RESULTS = Path(__file__).parent / "results" / "async_overlap.json"


def digit_share(prompts, completions, **_):
    """A dense reward (share of digits): every group has a spread, so every sample trains (as in a run that
    is learning), and training time does not collapse to the zero-advantage shortcut."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def config(model: str, out: Path, args, **extra) -> dict:
    cfg = {
        "model": {"path": model},
        "data": {"task": "addition", "num_train": 5000, "num_eval": 0, "task_reward_weight": 0.0},
        "generation": {"group_size": args.group_size, "max_tokens": args.max_tokens},
        "algorithm": {"ppo_epochs": args.ppo_epochs},
        "training": {"learning_rate": 1e-4, "seed": 0},
        "controller": {"steps": args.steps, "prompts_per_step": args.prompts},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    for key, value in extra.items():
        section, field = key.split(".")
        cfg.setdefault(section, {})[field] = value
    return cfg


def steps(out: Path, warmup: int) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing_s/step" in r and r["step"] > warmup]


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r.get(key, 0.0) for r in rows)


def pair(model: str, work: Path, args, i: int) -> dict:
    """One sync run, then one async run, same settings; their per-step means."""
    runs = {}
    load = os.getloadavg()[0]
    for name, extra in (
        ("sync", {}),
        ("async", {"engine.placement": args.placement, "engine.threads": 1,
                   "controller.max_staleness": args.staleness}),
    ):
        out = work / f"{name}{i}"
        t0 = time.perf_counter()
        tokenmill.train(config(model, out, args, **extra), rewards=[digit_share])
        runs[name] = (steps(out, args.warmup), time.perf_counter() - t0)
    sync, sync_wall = runs["sync"]
    asyn, async_wall = runs["async"]
    step_sync, step_async = mean(sync, "timing_s/step"), mean(asyn, "timing_s/step")
    gen = mean(sync, "timing_s/generate") + mean(sync, "timing_s/reward")
    train = step_sync - gen
    wait = mean(asyn, "timing_s/wait")
    return {
        "load_average_1min": [load, os.getloadavg()[0]],
        "sync": {"step_s": step_sync, "generate_s": gen, "train_s": train, "wall_s": sync_wall,
                 "generate_busy": gen / step_sync, "train_busy": train / step_sync},
        "async": {"step_s": step_async, "wall_s": async_wall, "wait_s": wait,
                  "train_s": mean(asyn, "timing_s/train"), "sync_s": mean(asyn, "timing_s/sync"),
                  "generate_busy": mean(asyn, "async/generate_busy"), "train_busy": 1 - wait / step_async,
                  "staleness_mean": mean(asyn, "async/staleness_mean"),
                  "buffer_fill_mean": mean(asyn, "async/buffer_fill"),
                  "producer_generate_s": mean(asyn, "async/producer_generate_s"),
                  "producer_reward_s": mean(asyn, "async/producer_reward_s"),
                  "bottleneck": max(("generation", "training"),
                                    key=lambda b: sum(r.get("async/bottleneck") == b for r in asyn))},
        "overlap_efficiency": max(gen, train) / step_async,
        "speedup": step_sync / step_async,
    }


def report(r: dict) -> None:
    s, a = r["sync"], r["async"]
    print(f"  sync : step {s['step_s']:.3f}s = generate {s['generate_s']:.3f}s + train {s['train_s']:.3f}s "
          f"(busy: generation {s['generate_busy']:.2f}, training {s['train_busy']:.2f})")
    print(f"  async: step {a['step_s']:.3f}s = wait {a['wait_s']:.3f}s + train {a['train_s']:.3f}s + weight push "
          f"{a['sync_s']:.3f}s + rest (busy: generation {a['generate_busy']:.2f}, training {a['train_busy']:.2f}); "
          f"producer per batch: generate {a['producer_generate_s']:.3f}s + reward {a['producer_reward_s']:.3f}s; "
          f"staleness mean {a['staleness_mean']:.2f}; bottleneck {a['bottleneck']}")
    print(f"  overlap efficiency max(gen, train) / async step = "
          f"{max(s['generate_s'], s['train_s']):.3f} / {a['step_s']:.3f} = {r['overlap_efficiency']:.2f} "
          f"(goal >= 0.85); speedup over sync {r['speedup']:.2f}x; load average {r['load_average_1min'][0]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placement", choices=["thread", "process"], default="process")
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="sync/async pairs, interleaved; the median is reported")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="async-overlap-"))
    model = build_tiny_model(work / "model", seed=0, **MODEL)
    print(f"settings: {args.prompts} prompts x {args.group_size} samples x {args.max_tokens} tokens, "
          f"{args.steps} steps ({args.warmup} warm-up not counted), placement {args.placement}, "
          f"max_staleness {args.staleness}, one torch thread per side")
    pairs = []
    for i in range(args.repeats):
        pairs.append(pair(model, work, args, i))
        print(f"pair {i + 1} of {args.repeats}:")
        report(pairs[-1])
    median = sorted(pairs, key=lambda r: r["overlap_efficiency"])[len(pairs) // 2]
    print("median pair (by overlap efficiency):")
    report(median)
    result = {
        "settings": {**vars(args), "output": str(args.output), "model": MODEL},
        "machine": {"cpus": os.cpu_count(), "torch_threads_per_side": 1, "platform": platform.platform(),
                    "torch": torch.__version__},
        "median": median,
        "pairs": pairs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
