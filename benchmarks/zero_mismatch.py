"""What `training.deterministic: true`'s zero mismatch costs: the quickstart's GRPO run (2-layer tiny Llama,
16 prompts x 8 samples, 6 new tokens, TIS on, `mismatch/*` every step) with it off and on, each in a process of
its own (deterministic mode sets process-wide torch state), the two alternating.

    python benchmarks/zero_mismatch.py [--steps 6] [--repeats 2]

Both sides run one torch thread (the mode fixes the count at 1; the default run is given 1 too), so the ratios
are those of the zero-mismatch machinery: the engine's scoring pass (`timing_s/rescore`) and the trainer's
one-row-per-sample forwards, not of the thread count. Rollout = generate + rescore; the first step (warm-up)
is left out of the medians. Writes benchmarks/results/zero_mismatch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "zero_mismatch.json"


def child(base: str, out: str, steps: int, deterministic: bool) -> None:
    import torch

    from tokenmill.recipes import grpo

    torch.set_num_threads(1)
    grpo(base, out, steps=steps, num_eval=8, eval_every=0, console="none", say=lambda _: None,
         **{"training.deterministic": deterministic, "algorithm.off_policy": "tis", "health.mismatch_every": 1,
            "checkpoint.save_final": False})


def summary(out: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r][1:]  # the first step warms up

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    return {"rollout_s": statistics.median(r["timing_s/generate"] + r.get("timing_s/rescore", 0.0) for r in rows),
            "generate_s": med("timing_s/generate"), "rescore_s": med("timing_s/rescore"), "train_s": med("timing_s/train"),
            "step_s": med("timing_s/step"), "mismatch_max_abs": max(r["mismatch/max_abs"] for r in rows),
            "is_weight_mean_min": min(r["is_weight_mean"] for r in rows),
            "is_weight_mean_max": max(r["is_weight_mean"] for r in rows)}


def main() -> None:
    from tokenmill.recipes import MODEL
    from tokenmill.recipes.tiny import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        base, out, steps, mode = args.child
        child(base, out, int(steps), mode == "on")
        return
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    env = {**os.environ, "TOKENMILL_DETERMINISTIC_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        base = str(build_tiny_model(Path(tmp) / "base", seed=0, **MODEL))
        for i in range(args.repeats):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                out = Path(tmp) / f"{mode}{i}"
                subprocess.run([sys.executable, __file__, "--child", base, str(out), str(args.steps), mode],
                               check=True, env=env)
                runs[mode].append(summary(out))
    result: dict = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    result["ratio_on_over_off"] = {k: result["on"][k] / result["off"][k]
                                   for k in ("rollout_s", "train_s", "step_s") if result["off"][k]}
    result |= {"steps": args.steps, "repeats": args.repeats}
    for mode in ("off", "on"):
        print(f"deterministic {mode:3s} " + "  ".join(f"{k} {v:.4g}" for k, v in result[mode].items()))
    print("on / off: " + "  ".join(f"{k} {v:.2f}x" for k, v in result["ratio_on_over_off"].items()))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
