"""How exact is kill -9 + resume? Final-weight differences of `tokenmill train` runs of one config.

    python benchmarks/determinism.py                   # both modes, one kill point
    python benchmarks/determinism.py --points all      # every kill point of tokenmill.testing.crash

For `training.deterministic` false and true: two uninterrupted runs (A, B), then for each kill point a
run SIGKILLed there and resumed. Printed and written to benchmarks/results/determinism.json: the max
absolute difference of every final weight between B and A (run-to-run noise) and between each resumed
run and A, plus how many of the killed trainer's processes were still alive 5 s after the kill.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenmill.testing import build_tiny_model
from tokenmill.testing.crash import (
    KILL_POINTS,
    final_weights,
    max_abs_diff,
    run_and_kill,
    run_to_end,
    write_config,
)


def _finish(config: Path, resume: bool) -> Path:
    done = run_to_end(config, resume=resume)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Path(json.loads(config.read_text())["tracking"]["output_dir"])


def measure(root: Path, model: str, deterministic: bool, points: list[str], overrides: dict) -> dict:
    tag = "det" if deterministic else "default"

    def config(name: str) -> Path:
        return write_config(root / f"{tag}-{name}", model, deterministic=deterministic, overrides=overrides)

    a = final_weights(_finish(config("a"), False))
    b = final_weights(_finish(config("b"), False))
    result = {"deterministic": deterministic, "uninterrupted_max_abs_diff": max_abs_diff(a, b), "kills": {}}
    for point in points:
        killed_config = config(point.replace("@", "-"))
        killed = run_and_kill(killed_config, point)
        start = time.monotonic()
        resumed = final_weights(_finish(killed_config, True))
        result["kills"][point] = {
            "max_abs_diff": max_abs_diff(a, resumed),
            "processes_at_kill": len(killed.children),
            "left_after_5s": len(killed.left_after_s),
            "resume_s": round(time.monotonic() - start, 1),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="checkpoint-model@2", help="comma-separated kill points, or 'all'")
    parser.add_argument("--modes", default="false,true", help="training.deterministic values to measure")
    parser.add_argument("--hidden", type=int, default=128, help="tiny model width (the quickstart's: 128)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="controller.prompts_per_step")
    parser.add_argument("--group", type=int, default=4, help="generation.group_size")
    parser.add_argument("--max-tokens", type=int, default=4, help="generation.max_tokens")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "determinism.json"))
    args = parser.parse_args()
    points = list(KILL_POINTS) if args.points == "all" else args.points.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", hidden_size=args.hidden, num_layers=args.layers)
        modes = [m.strip().lower() == "true" for m in args.modes.split(",")]
        overrides = {"controller": {"prompts_per_step": args.prompts},
                     "generation": {"group_size": args.group, "max_tokens": args.max_tokens}}
        results = [measure(root, model, det, points, overrides) for det in modes]
    for r in results:
        print(f"deterministic={r['deterministic']}: two uninterrupted runs differ by "
              f"{r['uninterrupted_max_abs_diff']:.3g}")
        for point, k in r["kills"].items():
            print(f"  kill -9 at {point} + resume: {k['max_abs_diff']:.3g}; {k['left_after_5s']} of "
                  f"{k['processes_at_kill']} child processes alive 5 s after the kill")
    setup = {k: getattr(args, k) for k in ("hidden", "layers", "prompts", "group", "max_tokens")}
    Path(args.out).write_text(json.dumps({"setup": setup, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
