"""What `training.deterministic: true`'s zero mismatch costs: the quickstart's GRPO run (2-layer tiny Llama,
16 prompts x 8 samples, TIS on, `mismatch/*` every step) in three modes, each run in a process of its own
(deterministic mode sets process-wide torch state), the order rotating between repeats:

    off         the default (batched forwards, fastest kernels)
    det         `training.deterministic: true`, `training.zero_mismatch: false` (bit-exact resume only)
    zero        `training.deterministic: true` (zero mismatch: the engine's scoring pass, one row per sample)

    python benchmarks/zero_mismatch.py [--steps 6] [--repeats 2] [--max-tokens 6]

Every mode runs one torch thread (deterministic mode fixes the count at 1; the default run is given 1 too),
so the ratios are not of the thread count. Rollout = generate + rescore (`timing_s/rescore`, the scoring
pass); the first step (warm-up) is left out of the medians. Writes benchmarks/results/zero_mismatch.json
(zero_mismatch_<max-tokens>.json for another --max-tokens).
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


MODES = {"off": {"training.deterministic": False}, "det": {"training.deterministic": True,
         "training.zero_mismatch": False}, "zero": {"training.deterministic": True}}


def child(base: str, out: str, steps: int, mode: str, max_tokens: int) -> None:
    import torch

    from tokenmill.recipes import grpo

    torch.set_num_threads(1)
    grpo(base, out, steps=steps, num_eval=8, eval_every=0, console="none", say=lambda _: None,
         **MODES[mode], **{"algorithm.off_policy": "tis", "health.mismatch_every": 1,
                           "checkpoint.save_final": False, "generation.max_tokens": max_tokens})


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
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        base, out, steps, mode = args.child
        child(base, out, int(steps), mode, args.max_tokens)
        return
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    env = {**os.environ, "TOKENMILL_DETERMINISTIC_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        base = str(build_tiny_model(Path(tmp) / "base", seed=0, **MODEL))
        for i in range(args.repeats):
            for j in range(len(MODES)):
                mode = list(MODES)[(i + j) % len(MODES)]
                out = Path(tmp) / f"{mode}{i}"
                subprocess.run([sys.executable, __file__, "--child", base, str(out), str(args.steps), mode,
                                "--max-tokens", str(args.max_tokens)], check=True, env=env)
                runs[mode].append(summary(out))
    result: dict = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    for num, den in (("zero", "off"), ("zero", "det"), ("det", "off")):
        result[f"ratio_{num}_over_{den}"] = {k: result[num][k] / result[den][k]
                                             for k in ("rollout_s", "train_s", "step_s") if result[den][k]}
    result |= {"steps": args.steps, "repeats": args.repeats, "max_tokens": args.max_tokens}
    for mode in MODES:
        print(f"{mode:4s} " + "  ".join(f"{k} {v:.4g}" for k, v in result[mode].items()))
    for key in (k for k in result if k.startswith("ratio_")):
        print(f"{key}: " + "  ".join(f"{k} {v:.2f}x" for k, v in result[key].items()))
    path = RESULTS if args.max_tokens == 6 else RESULTS.with_name(f"zero_mismatch_{args.max_tokens}.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
