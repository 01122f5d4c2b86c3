"""Mixed-length episodes: does a short episode wait for a long one?

    python benchmarks/agent_episodes.py              # 256 episodes of 1-8 turns, 32 at a time (~1 min)

Episodes last 1 to 8 turns (uniform, seeded); every turn samples up to 8 tokens from the quickstart-sized
tiny model. Both schedules run the same episodes with the same engine and at most `--slots` live episodes:

- refill (tokenmill's agent loop): a finished episode's slot goes to the next queued episode before the
  next engine batch, so the batch stays full until the queue runs dry;
- waves (what a loop that batches whole episodes does): `--slots` episodes start together and the next wave
  starts when the longest of them has finished.

Printed: wall seconds, episodes/s, engine batch occupancy (rows per engine call / slots), engine calls, and
the ratio refill / waves. Results go to benchmarks/results/agent_episodes.json.
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
    return {
        "seconds": round(seconds, 2),
        "episodes_per_s": round(len(episodes) / seconds, 2),
        "rounds": s.rounds,
        "engine_calls": s.engine_calls,
        "batch_occupancy": round(s.engine_rows / (s.rounds * slots), 3),
        "turns": sum(len(e.turn_rewards) for e in episodes),
        "failed": s.failed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--length-ratio", type=float, default=None,
                   help="AgentLimits.length_ratio (default: the library's); 0 = one engine call per round")
    p.add_argument("--out", default="benchmarks/results/agent_episodes.json")
    args = p.parse_args()
    torch.set_num_threads(2)

    from tokenmill.engines.hf import HFEngine
    from tokenmill.rollout.agent import AgentLimits, AgentLoop
    from tokenmill.testing.quickstart import MODEL
    from tokenmill.testing.tiny import build_tiny_model
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
    run_schedule(loop, tasks[: args.slots], args.slots, waves=False)  # warm-up
    results = {}
    for name, waves in (("refill", False), ("waves", True)):
        results[name] = run_schedule(loop, tasks, args.slots, waves)
        print(f"{name:7s} {results[name]}", flush=True)
    r, w = results["refill"], results["waves"]
    ideal = -(-sum(t["turns"] for t in tasks) // args.slots)  # engine calls with every slot always busy
    summary = {
        "episodes": args.episodes, "slots": args.slots, "turns": f"1-{args.max_turns}", "ideal_engine_calls": ideal,
        "refill": r, "waves": w, "episodes_per_s_ratio": round(r["episodes_per_s"] / w["episodes_per_s"], 2),
    }
    print(f"\n| schedule | wall s | episodes/s | engine calls (ideal {ideal}) | batch occupancy |\n|---|---|---|---|---|")
    for name in ("refill", "waves"):
        x = results[name]
        print(f"| {name} | {x['seconds']} | {x['episodes_per_s']} | {x['engine_calls']} | {x['batch_occupancy']} |")
    print(f"\nrefill / waves episodes/s: {summary['episodes_per_s_ratio']}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
