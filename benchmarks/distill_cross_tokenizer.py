"""On-policy distillation from a teacher with another tokenizer: a byte-level BPE teacher teaches the
quickstart's character-level student through aligned text spans (`distillation.teacher_tokenizer: auto`).

    OMP_NUM_THREADS=1 python benchmarks/distill_cross_tokenizer.py [--steps 40] [--threads 1]

The student is the quickstart's warm model (character tokenizer: one token per digit; sloppy warm start). The
teacher is a Llama 192 wide with 3 layers over `recipes.tiny_bpe`'s byte-level BPE cut by `LEADING_ONE` (a sum
past 100 starts with one of the tokens `10` to `19`: `135` is `13`, `5`), supervised 1,200 steps on correct
sums. Distillation with the sampled estimate on aligned spans, 128 prompts x 1 sample a step at learning rate
1e-4 (the single-teacher benchmark's settings), held-out greedy accuracy on 500 problems every 10 steps.
Writes benchmarks/results/distill_cross_tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "distill_cross_tokenizer.json"
TEACHER = {"hidden_size": 192, "num_layers": 3}  # the single-teacher benchmark's teacher shape
DISTILL = {"generation.group_size": 1, "controller.prompts_per_step": 128, "training.learning_rate": 1e-4}


def bpe_teacher(work: Path, *, sft_steps: int = 1200, seed: int = 0) -> Path:
    """The teacher: a tiny Llama over the byte-level BPE, supervised on correct sums for `sft_steps` steps."""
    from tokenmill.config.schema import ModelConfig
    from tokenmill.data.registry import task_splits
    from tokenmill.recipes.tiny_bpe import LEADING_ONE, build_tiny_bpe_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    base = build_tiny_bpe_model(work / "teacher_base", seed=seed + 1, split=LEADING_ONE, **TEACHER)
    rows, _, _ = task_splits("addition", 20000, 500, seed=seed, slip=0.0)
    model, tok = load_policy(ModelConfig(path=base), resolve_device("cpu"))
    run_sft(model, tok, rows, steps=sft_steps, batch_size=64, learning_rate=1e-3, seed=seed,
            output_dir=work / "teacher")
    return work / "teacher"


def cross_tokenizer_curve(warm: Path, work: Path, *, steps: int = 40, every: int = 10, num_eval: int = 500,
                          teacher_steps: int = 1200, seed: int = 0) -> dict:
    """Build the BPE teacher, distil the warm student from it, and return the curve with the alignment's
    metrics (tokens per span, unaligned tokens) and the reverse KL per span, first and last 5 steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from learning import curve, held_out_accuracy

    from tokenmill.recipes import grpo

    t0 = time.time()
    teacher = bpe_teacher(work, sft_steps=teacher_steps, seed=seed)
    teacher_acc = held_out_accuracy(teacher, work / "teacher_eval", num_eval)
    print(f"BPE teacher: held-out accuracy {teacher_acc:.3f} ({time.time() - t0:.0f} s)", flush=True)
    grpo(warm, work / "distill", steps=steps, num_eval=num_eval, eval_every=every, console="none",
         say=lambda _: None, seed=seed, **{"algorithm.advantage": "distill", "distillation.teacher.path": str(teacher),
                                           "distillation.teacher_tokenizer": "auto", **DISTILL})
    rows = [json.loads(line) for line in (work / "distill" / "metrics.jsonl").read_text().splitlines()]
    per_step = [r for r in rows if "distill/reverse_kl" in r]

    def mean(key, part):
        return round(sum(r[key] for r in part) / len(part), 3)

    points = sorted(dict(curve(work / "distill")).items())
    return {"objective": "distill_cross_tokenizer", "metric": "held-out greedy accuracy", "teacher_accuracy":
            teacher_acc, "before": points[0][1], "after": points[-1][1], "curve": points,
            "reverse_kl_per_span_first_last_5": [mean("distill/reverse_kl", per_step[:5]),
                                                 mean("distill/reverse_kl", per_step[-5:])],
            "tokens_per_span": mean("distill/tokens_per_span", per_step),
            "unaligned_tokens": sum(r["distill/unaligned_tokens"] for r in per_step),
            "seconds": round(time.time() - t0, 1), "flags": {"teacher_tokenizer": "auto", **DISTILL}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from tokenmill.recipes import warm_start

    with tempfile.TemporaryDirectory() as tmp:
        warm = warm_start(Path(tmp), num_eval=500, say=print)
        row = cross_tokenizer_curve(warm, Path(tmp), steps=args.steps)
    print(json.dumps(row, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
