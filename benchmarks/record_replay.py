"""The rollout dump of the quickstart's 200-step GRPO run: its size on disk, and a replay of it.

    python benchmarks/record_replay.py               # warm start, 200 recorded steps, then the replay
    python benchmarks/record_replay.py --steps 50
    python benchmarks/record_replay.py --warm runs/quickstart/warm   # reuse a warm start

Runs the quickstart recipe (tiny model, sloppy-teacher warm start, GRPO 16 prompts x 8 samples) with
`record.rollouts` on, then `record.replay` of its dump with the same seed and no engine. Printed and written
to benchmarks/results/record_replay.json: the dump's bytes, shards and rows, the seconds of each run, and the
largest final-weight difference between the run and its replay (0.0 is bit for bit).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tokenmill.recipes import grpo, warm_start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warm", default=None, help="a warm-started model folder (skips the warm start)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        warm = args.warm or warm_start(root, say=lambda _: None)
        t0 = time.time()
        live = grpo(warm, root / "live", steps=args.steps, console="none", say=lambda _: None, num_eval=200,
                    eval_every=0, **{"record.rollouts": True})
        t_live = time.time() - t0
        dump = root / "live" / "rollouts"
        shards = sorted(dump.glob("*.parquet"))
        size = sum(p.stat().st_size for p in shards)
        import pyarrow.parquet as pq

        rows = sum(pq.ParquetFile(p).metadata.num_rows for p in shards)
        t0 = time.time()
        grpo(warm, root / "replay", steps=args.steps, console="none", say=lambda _: None, num_eval=200, eval_every=0,
             **{"record.replay": str(dump)})
        t_replay = time.time() - t0
        a = load_file(str(root / "live" / "final" / "model.safetensors"))
        b = load_file(str(root / "replay" / "final" / "model.safetensors"))
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    result = {
        "steps": args.steps, "dump_bytes": size, "dump_mib": round(size / 2**20, 3), "shards": len(shards),
        "rows": rows, "run_s": round(t_live, 1), "replay_s": round(t_replay, 1), "max_weight_diff": diff,
        "eval_before": live["eval_before"]["eval/accuracy"], "eval_after": live["eval_after"]["eval/accuracy"],
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "record_replay.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
