"""Mixed-length episodes: does a short episode wait for a long one?

    python benchmarks/agent_episodes.py              # 512 episodes of 1-8 turns, 32 at a time (~2 min)

Episodes last 1 to 8 turns (uniform, seeded); every turn samples up to 8 tokens from the quickstart-sized
tiny model. Both schedules run the same episodes with the same engine and at most `--slots` live episodes:

- refill (tokenmill's agent loop): a finished episode's slot goes to the next queued episode before the
  next engine batch, so the batch stays full until the queue runs dry;
- waves (what a loop that batches whole episodes does): `--slots` episodes start together and the next wave
  starts when the longest of them has finished.

Each schedule runs with the engine's prefix cache off (every turn re-reads its whole history, padded to the
batch's longest) and on (a turn reads only what is new since the last one), `--repeats` times, interleaved.
Printed: median wall seconds, episodes/s, rounds (one per turn of all live episodes), engine calls, batch
occupancy (live episodes per round / slots), and ratios. Results go to benchmarks/results/agent_episodes.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from tokenmill.envs.base import StepResult


class FixedTurns:
    """An episode of exactly `task["turns"]` policy turns, whatever the policy says."""

    def __init__(self) -> None:
        self.left = 0

    def reset(self, task):
        self.left = int(task["turns"])
        return [{"role": "user", "content": f"talk {self.left}"}]

    def step(self, message):
        self.left -= 1
        return StepResult([{"role": "user", "content": "go on"}], 0.0, self.left <= 0)

    def close(self):
        pass


def run_schedule(loop, tasks, slots: int, waves: bool) -> dict:
    from tokenmill.rollout.agent import AgentStats

    queue = [(t, i) for i, t in enumerate(tasks)]
    loop.stats = AgentStats()
    start = time.perf_counter()
    if waves:
        episodes = []
        for i in range(0, len(queue), slots):
            episodes += asyncio.run(loop.run(queue[i : i + slots]))
    else:
        episodes = asyncio.run(loop.run(queue))
    seconds = time.perf_counter() - start
    s = loop.stats
    short = [e for e, t in zip(episodes, tasks, strict=True) if t["turns"] <= 2]
    return {
        "seconds": round(seconds, 2),
        "episodes_per_s": round(len(episodes) / seconds, 2),
        "rounds": s.rounds,
        "engine_calls": s.engine_calls,
        "batch_occupancy": round(s.engine_rows / (s.rounds * slots), 3),
        "turns": sum(len(e.turn_rewards) for e in episodes),
        "failed": s.failed,
        # when an episode's result is ready, from the start of the run: waves hold a short episode's
        # successor back until the wave's longest episode ends
        "mean_done_s": round(sum(e.finished - start for e in episodes) / len(episodes), 3),
        "short_mean_done_s": round(sum(e.finished - start for e in short) / max(1, len(short)), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="runs of each schedule (interleaved); the median counts")
    p.add_argument("--length-ratio", type=float, default=None,
                   help="AgentLimits.length_ratio (default: the library's); 0 = one engine call per round")
    p.add_argument("--prefix-cache-tokens", type=int, default=1 << 18,
                   help="engine prefix cache for the 'cached' rows (the 'uncached' rows re-read every history)")
    p.add_argument("--out", default="benchmarks/results/agent_episodes.json")
    args = p.parse_args()
    torch.set_num_threads(2)

    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.recipes import MODEL
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.rollout.agent import AgentLimits, AgentLoop
    from tokenmill.types import SamplingParams

    path = build_tiny_model(Path(tempfile.mkdtemp(prefix="tokenmill_agent_")) / "m", seed=0, **MODEL)
    engine = HFEngine.from_pretrained(path, seed=0)
    limits = AgentLimits(max_turns=args.max_turns, max_episode_tokens=4096, max_concurrent=args.slots,
                         end_on_truncation=False)
    if args.length_ratio is not None:
        limits = replace(limits, length_ratio=args.length_ratio)
    loop = AgentLoop(engine, engine.tokenizer, FixedTurns, SamplingParams(max_tokens=8, n=1), limits)
    rng = random.Random(0)
    tasks = [{"turns": rng.randint(1, args.max_turns)} for _ in range(args.episodes)]
    results: dict[str, dict] = {}
    for cache in ("uncached", "cached"):
        engine.enable_prefix_cache(args.prefix_cache_tokens if cache == "cached" else 0)
        run_schedule(loop, tasks[: args.slots], args.slots, waves=False)  # warm-up
        runs: dict[str, list[dict]] = {"refill": [], "waves": []}
        for _ in range(args.repeats):
            for name, xs in runs.items():
                if engine.prefix_cache is not None:
                    engine.prefix_cache.clear()  # each run starts cold
                xs.append(run_schedule(loop, tasks, args.slots, waves=name == "waves"))
        for name, xs in runs.items():
            best = sorted(xs, key=lambda x: x["seconds"])[len(xs) // 2]  # the median run
            results[f"{name}, {cache}"] = {**best, "seconds_all": [x["seconds"] for x in xs]}
            print(f"{name}, {cache}: {results[f'{name}, {cache}']}", flush=True)
    ideal = -(-sum(t["turns"] for t in tasks) // args.slots)  # rounds with every slot always busy
    base = results["waves, uncached"]["episodes_per_s"]
    summary = {"episodes": args.episodes, "slots": args.slots, "turns": f"1-{args.max_turns}",
               "ideal_rounds": ideal, "length_ratio": limits.length_ratio, "results": results,
               "episodes_per_s_vs_waves_uncached": {k: round(v["episodes_per_s"] / base, 2) for k, v in results.items()}}
    print(f"\n| schedule | median wall s | episodes/s | vs waves, uncached | rounds (ideal {ideal}) | engine calls "
          "| batch occupancy | mean s to result (1-2 turn episodes) |\n|---|---|---|---|---|---|---|---|")
    for name, x in results.items():
        print(f"| {name} | {x['seconds']} | {x['episodes_per_s']} | {x['episodes_per_s'] / base:.2f}x | {x['rounds']} "
              f"| {x['engine_calls']} | {x['batch_occupancy']} | {x['mean_done_s']} ({x['short_mean_done_s']}) |")
    ratio = results["refill, cached"]["episodes_per_s"] / results["waves, cached"]["episodes_per_s"]
    summary["refill_vs_waves_cached"] = round(ratio, 2)
    print(f"\nrefill / waves (both with the prefix cache), episodes/s: {ratio:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
