"""Soak: a 200-step `tokenmill train` on the CPU killed 10 times at random (SIGKILL, SIGTERM, SIGINT) and resumed
each time; does it end bit for bit where an uninterrupted run ends?

    python benchmarks/chaos.py                       # 200 steps, 10 kills, seed 0 (~3-5 min on 2 cores)
    python benchmarks/chaos.py --steps 60 --kills 4  # a quick look

The run is `tokenmill.testing.crash.write_config`'s tiny GRPO job (`training.deterministic: true`, process-
isolated reward workers) with a checkpoint every `--every` steps. The kills are an even mix of the three kinds in an
order drawn from a seeded RNG, and so are their times: a step to wait for, then a delay of up to one step into
the next. SIGTERM goes to the trainer alone (as `docker stop` and Kubernetes send it), SIGINT to its process group
(as a terminal's Ctrl-C). After each kill the run is started again with `--checkpoint.resume true`; after the
last, it runs to its end. Printed and written to benchmarks/results/chaos.json: per kill, its kind, the step it
landed in, the exit status, the steps lost (steps the killed process finished beyond the checkpoint it left:
up to `--every` for SIGKILL, 0 for a saved stop), for SIGTERM / SIGINT the seconds from the signal to the
saved checkpoint and to the exit; and whether the final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.checkpoint.atomic import latest_checkpoint
from tokenmill.checkpoint.preempt import EXIT_PREEMPTED
from tokenmill.testing import build_tiny_model
from tokenmill.testing.crash import final_weights, max_abs_diff, run_and_signal, run_to_end, write_config

KINDS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
SAVED = re.compile(r"after step (\d+)\b.* ([0-9.]+) s after the signal")


def plan(rng: random.Random, kills: int, steps: int) -> list[tuple[signal.Signals, int, float]]:
    """(signal, step to wait for, fraction of a step to wait after it) of each kill, in order."""
    kinds = [KINDS[i % len(KINDS)] for i in range(kills)]  # as even a mix as the count allows, in a random order
    rng.shuffle(kinds)
    targets = sorted(rng.sample(range(2, steps - 2), kills))
    return [(kind, target, rng.random()) for kind, target in zip(kinds, targets, strict=True)]


def _resumed_from(out: Path) -> int:
    found = latest_checkpoint(out / "checkpoints")
    return int(found.name.split("_")[1]) if found else 0


def kill_once(config: Path, out: Path, kind: signal.Signals, target: int, fraction: float, step_s: float) -> dict:
    """One run (a resume after the first) signalled once it has finished step `target`, `fraction` of a step
    later."""
    start_step = _resumed_from(out)
    got = run_and_signal(config, [kind], after_rows=max(1, target - start_step), delay_s=fraction * step_s,
                         resume=start_step > 0 or (out / "checkpoints").is_dir(), group=kind == signal.SIGINT,
                         timeout=300)
    finished = start_step + got.steps_done  # the last step this process completed
    left = _resumed_from(out)
    row = {"signal": kind.name, "resumed_from": start_step, "signalled_after_step": start_step + got.steps_logged,
           "returncode": got.returncode, "last_finished_step": finished, "checkpoint_left": left,
           "steps_lost": finished - left, "exit_s": round(got.exit_s, 2)}
    if kind != signal.SIGKILL:
        saved = SAVED.search(got.stderr)
        row["save_s"] = float(saved.group(2)) if saved else None
        if got.returncode != EXIT_PREEMPTED or saved is None or int(saved.group(1)) != left:
            raise SystemExit(f"{kind.name} did not end in a saved stop ({got.returncode}):\n{got.stderr[-3000:]}")
    return row


def soak(root: Path, model: str, args: argparse.Namespace) -> dict:
    overrides = {"checkpoint": {"every": args.every, "keep_last": 2},
                 "controller": {"prompts_per_step": args.prompts}}
    base = write_config(root / "uninterrupted", model, steps=args.steps, overrides=overrides)
    began = time.monotonic()
    done = run_to_end(base)
    if done.returncode != 0:
        raise SystemExit(f"uninterrupted run failed:\n{done.stderr[-3000:]}")
    uninterrupted_s = time.monotonic() - began
    expected = final_weights(root / "uninterrupted" / "run")
    rows = [json.loads(x) for x in (root / "uninterrupted" / "run" / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["timing_s/step"] for r in rows if "timing_s/step" in r)
    config = write_config(root / "chaos", model, steps=args.steps, overrides=overrides)
    out = root / "chaos" / "run"
    kills, began = [], time.monotonic()
    for kind, target, fraction in plan(random.Random(args.seed), args.kills, args.steps):
        kills.append(kill_once(config, out, kind, target, fraction, step_s))
        k = kills[-1]
        print(f"kill {len(kills):2d}: {k['signal']:7s} in step {k['signalled_after_step'] + 1:3d} -> exit "
              f"{k['returncode']:4d}, checkpoint {k['checkpoint_left']:3d}, {k['steps_lost']} step(s) lost"
              + (f", saved {k['save_s']:.2f} s after the signal" if k.get("save_s") is not None else ""), flush=True)
    done = run_to_end(config, resume=True)
    if done.returncode != 0:
        raise SystemExit(f"final resume failed:\n{done.stderr[-3000:]}")
    chaos_s = time.monotonic() - began
    got = final_weights(out)
    equal = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    by_kind = {kind.name: [k for k in kills if k["signal"] == kind.name] for kind in KINDS}
    return {
        "setup": {k: getattr(args, k) for k in ("steps", "kills", "every", "prompts", "seed")}
                 | {"median_step_s": round(step_s, 3)},
        "kills": kills,
        "summary": {name: {"count": len(ks), "steps_lost": [k["steps_lost"] for k in ks],
                           "save_s": [k["save_s"] for k in ks if "save_s" in k],
                           "exit_s": [k["exit_s"] for k in ks]} for name, ks in by_kind.items()},
        "final_bit_identical": equal,
        "final_max_abs_diff": max_abs_diff(got, expected),
        "uninterrupted_s": round(uninterrupted_s, 1),
        "chaos_s": round(chaos_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every")
    parser.add_argument("--prompts", type=int, default=4, help="controller.prompts_per_step")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kinds and times of the kills")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chaos.json"))
    args = parser.parse_args()
    if args.kills < len(KINDS) or args.kills > args.steps - 4:
        parser.error(f"--kills: between {len(KINDS)} and --steps - 4")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
        result = soak(root, model, args)
    for name, s in result["summary"].items():
        saves = f", saved in {', '.join(f'{x:.2f}' for x in s['save_s'])} s" if s["save_s"] else ""
        print(f"{name}: {s['count']} kill(s), steps lost {s['steps_lost']}{saves}")
    print(f"final weights bit-identical to the uninterrupted run: {result['final_bit_identical']} (max abs diff "
          f"{result['final_max_abs_diff']:.3g}); uninterrupted {result['uninterrupted_s']} s, with the kills "
          f"{result['chaos_s']} s")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
