"""Synchronous vs asynchronous GRPO on this machine: same settings, same model, interleaved rounds.

    python benchmarks/async_overlap.py                        # sync, thread, worker and process placements (~3 min)
    python benchmarks/async_overlap.py --placements process   # only the `tokenmill serve` process
    python benchmarks/async_overlap.py --placements process --process-sync broadcast --output X.json

The sync run alternates generation (generate + reward) and training (train + sync) on one torch thread; its
per-step times give `gen` and `train`. Each async run (`controller.max_staleness`, default 1) puts the engine
elsewhere (thread: an engine copy in a producer thread; worker: that engine in a worker process, weights
through shared memory; process: a `tokenmill serve` subprocess) with one
torch thread for generation and one for training, so the two overlap. Printed per round and for the median
round: each run's step time, the per-stage busy fractions, overlap efficiency = max(gen, train) / async step
time (1.0 = perfect overlap; goal >= 0.85), the same with the async run's own stage times (an engine in
another process may generate slower than the in-process one) and the speedup over sync, with the load
average (other processes on this shared 2-core machine skew single runs, hence interleaved rounds). The first
`--warmup` steps of each run are not counted. Results: benchmarks/results/async_overlap.json.
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
from tokenmill.recipes import MODEL
from tokenmill.recipes.tiny import build_tiny_model

RESULTS = Path(__file__).parent / "results" / "async_overlap.json"


def _shown(path: Path) -> str:
    repo = Path(__file__).resolve().parents[1]
    resolved = path.resolve()
    return str(resolved.relative_to(repo)) if resolved.is_relative_to(repo) else path.name


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


def async_stats(rows: list[dict], sync_gen: float, sync_train: float, sync_step: float, wall: float) -> dict:
    step, wait = mean(rows, "timing_s/step"), mean(rows, "timing_s/wait")
    producer = mean(rows, "async/producer_generate_s") + mean(rows, "async/producer_reward_s")
    return {
        "step_s": step, "wall_s": wall, "wait_s": wait, "train_s": mean(rows, "timing_s/train"),
        "sync_s": mean(rows, "timing_s/sync"), "producer_batch_s": producer,
        "generate_busy": mean(rows, "async/generate_busy"), "train_busy": 1 - wait / step,
        "staleness_mean": mean(rows, "async/staleness_mean"), "buffer_fill_mean": mean(rows, "async/buffer_fill"),
        "bottleneck": max(("generation", "training"),
                          key=lambda b: sum(r.get("async/bottleneck") == b for r in rows)),
        # the brief's measure: the sync run's stage times against the async step
        "overlap_efficiency": max(sync_gen, sync_train) / step,
        # the async run's own stages (the engine elsewhere may generate slower than in-process)
        "self_overlap": max(producer, step - wait) / step,
        "speedup": sync_step / step,
    }


def pair(model: str, work: Path, args, i: int) -> dict:
    """One sync run, then one async run per placement, same settings; their per-step means."""
    load = os.getloadavg()[0]
    runs = {}
    for name in ("sync", *args.placements):
        extra = {} if name == "sync" else {"engine.placement": name, "engine.threads": 1,
                                           "controller.max_staleness": args.staleness}
        if name == "process":
            extra["engine.sync"] = args.process_sync
        out = work / f"{name}{i}"
        t0 = time.perf_counter()
        tokenmill.train(config(model, out, args, **extra), rewards=[digit_share])
        runs[name] = (steps(out, args.warmup), time.perf_counter() - t0)
    sync, wall = runs.pop("sync")
    step = mean(sync, "timing_s/step")
    gen = mean(sync, "timing_s/generate") + mean(sync, "timing_s/reward")
    out = {"load_average_1min": [load, os.getloadavg()[0]],
           "sync": {"step_s": step, "generate_s": gen, "train_s": step - gen, "wall_s": wall,
                    "generate_busy": gen / step, "train_busy": (step - gen) / step}}
    for name, (rows, wall) in runs.items():
        out[name] = async_stats(rows, gen, step - gen, step, wall)
    return out


def report(r: dict, placements: list[str]) -> None:
    s = r["sync"]
    print(f"  sync   : step {s['step_s']:.3f}s = generate {s['generate_s']:.3f}s + train {s['train_s']:.3f}s "
          f"(busy: generation {s['generate_busy']:.2f}, training {s['train_busy']:.2f}); "
          f"load average {r['load_average_1min'][0]:.1f}")
    for name in placements:
        a = r[name]
        print(f"  {name:7s}: step {a['step_s']:.3f}s = wait {a['wait_s']:.3f}s + train {a['train_s']:.3f}s + "
              f"push {a['sync_s']:.3f}s + rest; producer {a['producer_batch_s']:.3f}s per batch (busy: "
              f"generation {a['generate_busy']:.2f}, training {a['train_busy']:.2f}); staleness "
              f"{a['staleness_mean']:.2f}; bottleneck {a['bottleneck']}")
        print(f"           overlap efficiency max(gen, train) / async step = {max(s['generate_s'], s['train_s']):.3f}"
              f" / {a['step_s']:.3f} = {a['overlap_efficiency']:.2f} (goal >= 0.85; own stages: "
              f"{a['self_overlap']:.2f}); speedup over sync {a['speedup']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placements", nargs="+", choices=["thread", "worker", "process"],
                   default=["thread", "worker", "process"])
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--process-sync", choices=["files", "broadcast"], default="files",
                   help="engine.sync of the process placement (files is the config's default)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median round is reported")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="async-overlap-"))
    model = build_tiny_model(work / "model", seed=0, **MODEL)
    print(f"settings: {args.prompts} prompts x {args.group_size} samples x {args.max_tokens} tokens, "
          f"{args.steps} steps ({args.warmup} warm-up not counted), max_staleness {args.staleness}, "
          f"one torch thread per side; placements {', '.join(args.placements)}")
    rounds = []
    for i in range(args.repeats):
        rounds.append(pair(model, work, args, i))
        print(f"round {i + 1} of {args.repeats}:")
        report(rounds[-1], args.placements)
    key = args.placements[0]
    median = sorted(rounds, key=lambda r: r[key]["overlap_efficiency"])[len(rounds) // 2]
    print(f"median round (by {key} overlap efficiency):")
    report(median, args.placements)
    result = {
        # the output path relative to the repository, so a results file names no machine's folders
        "settings": {**vars(args), "output": _shown(args.output), "model": MODEL},
        "machine": {"cpus": os.cpu_count(), "torch_threads_per_side": 1, "platform": platform.platform(),
                    "torch": torch.__version__},
        "median": median,
        "rounds": rounds,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
