"""Does a tiny model learn reasoning-gym tasks? A warm start per task, then GRPO with the generator's own
`score_answer` as the reward, held-out greedy accuracy before and after.

    python benchmarks/reasoning_gym_learning.py                  # every task (~10 min on 1 thread)
    python benchmarks/reasoning_gym_learning.py --only spell_backward   # one task; the file keeps the others

Each task is a `data.task: reasoning_gym:<name>` run with `answer_format: last_line` (the completion is the
answer), chosen so that questions and answers are short strings of the quickstart tokenizer's characters. As
in the quickstart, the warm start learns from a sloppy teacher (`SLIPS`): basic_arithmetic's forgets the carry,
spell_backward's copies the word instead of reversing it, each in `--slip` of the rows; the mixture draws both
tasks by weight, each with its own slip. GRPO must then prefer the right answer, which only the reward knows.
Held-out rows come from the registry's held-out seed and none of their questions is trained on. Results go
to benchmarks/results/reasoning_gym_learning.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# two-digit operands: a space of 8,100 questions, so that 500 held-out ones leave nearly all of it to train on
ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
              "allow_parentheses": False, "allow_negation": False}
SPELLING = {"min_word_len": 3, "max_word_len": 5}
# per task: its settings, the completion budget, warm-start steps, GRPO steps and learning rate (spelling's
# prompts are 3x longer than arithmetic's; the mixture's GRPO at 1e-4 gained 4-7 points, at 2e-4 more)
TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"task": "reasoning_gym:basic_arithmetic", "kwargs": ARITHMETIC, "max_tokens": 5,
                         "sft_steps": 1200, "steps": 200, "lr": 1e-4},
    "spell_backward": {"task": "reasoning_gym:spell_backward", "kwargs": SPELLING, "max_tokens": 7,
                       "sft_steps": 500, "steps": 120, "lr": 1e-4},
    "mix": {"task": "reasoning_gym:mix", "max_tokens": 7, "sft_steps": 800, "steps": 350, "lr": 2e-4, "kwargs": {"datasets": [
        {"name": "basic_arithmetic", "weight": 1.0, "kwargs": ARITHMETIC},
        {"name": "spell_backward", "weight": 1.0, "kwargs": SPELLING}]}},
}


def _forgot_carry(row: dict[str, Any]) -> str:
    from tokenmill.data.tasks import forgot_carry

    a, b = (int(x) for x in row["question"].removeprefix("Calculate ").rstrip(".").split(" + "))
    return str(forgot_carry(a, b))


def _unreversed(row: dict[str, Any]) -> str:
    return row["question"].rpartition(" ")[2]  # the word as given: copied, not spelled backward


SLIPS = {"basic_arithmetic": _forgot_carry, "spell_backward": _unreversed}


def sloppy(rows, slip: float, seed: int):
    """The rows with the teacher's completion: the task's slip in a share `slip` of them, else the answer."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": row["prompt"], "completion": SLIPS[row["rg_task"]](row)
                               if rng.random() < slip else row["completion"]} for row in rows])


def warm_start(work: Path, spec: dict[str, Any], *, sft_steps: int, slip: float, seed: int) -> Path:
    """The quickstart's tiny Llama and character tokenizer, supervised on the sloppy teacher's answers."""
    from tokenmill.config.schema import ModelConfig
    from tokenmill.data.registry import task_splits
    from tokenmill.recipes import MODEL
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    base = build_tiny_model(work / "base", seed=seed, **MODEL)
    rows, _, _ = task_splits(spec["task"], 20000, 500, seed=seed, answer_format="last_line", **spec["kwargs"])
    model, tok = load_policy(ModelConfig(path=base), resolve_device("cpu"))
    losses = run_sft(model, tok, sloppy(rows, slip, seed), steps=sft_steps, batch_size=64, learning_rate=1e-3,
                     seed=seed, output_dir=work / "warm")
    print(f"  warm start: {sft_steps} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)
    return work / "warm"


def run_task(name: str, work: Path, args) -> dict[str, Any]:
    from tokenmill.recipes import grpo

    spec = TASKS[name]
    start = time.time()
    sft_steps, steps, lr = args.sft_steps or spec["sft_steps"], args.steps or spec["steps"], args.lr or spec["lr"]
    warm = warm_start(work / name, spec, sft_steps=sft_steps, slip=args.slip, seed=args.seed)
    result = grpo(warm, work / name / "grpo", steps=steps, learning_rate=lr, num_eval=args.num_eval,
                  eval_every=0,
                  console="none", seed=args.seed, say=lambda _: None, **{
                      "data.task": spec["task"], "data.task_kwargs": {"answer_format": "last_line", **spec["kwargs"]},
                      "generation.max_tokens": spec["max_tokens"]})
    before, after = result["eval_before"]["eval/accuracy"], result["eval_after"]["eval/accuracy"]
    row = {"task": spec["task"], "task_kwargs": spec["kwargs"], "metric": "held-out greedy accuracy",
           "before": round(before, 3), "after": round(after, 3), "gain_points": round(100 * (after - before), 1),
           "num_eval": args.num_eval, "steps": steps, "lr": lr, "sft_steps": sft_steps, "slip": args.slip,
           "seconds": round(time.time() - start)}
    print(f"{name:18s} held-out accuracy {before:.3f} -> {after:.3f} ({row['gain_points']:+.1f} points, "
          f"{row['seconds']} s)", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(TASKS), help=f"comma-separated tasks of {', '.join(TASKS)}")
    p.add_argument("--steps", type=int, default=0, help="GRPO steps of 16 prompts x 8 samples (0: the task's)")
    p.add_argument("--lr", type=float, default=0.0, help="GRPO learning rate (0: the task's)")
    p.add_argument("--sft-steps", type=int, default=0, help="warm-start steps (0: the task's)")
    p.add_argument("--slip", type=float, default=0.6, help="share of the warm start's rows with the teacher's slip")
    p.add_argument("--num-eval", type=int, default=500, help="held-out problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="benchmarks/results/reasoning_gym_learning.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_task(name, Path(tmp), args) for name in names]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text())["rows"] if out.exists() else []  # the other tasks' last results
    rows = [r for r in kept if r["task"] not in {row["task"] for row in rows}] + rows
    out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")
    print(f"results in {out}")


if __name__ == "__main__":
    main()
