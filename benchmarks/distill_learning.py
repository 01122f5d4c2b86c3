"""Distillation beyond one teacher, and the single-teacher bar, measured on tiny models on the CPU.

    python benchmarks/distill_learning.py --only multi,self,bound --out benchmarks/results/distill_learning.json

Every row starts from one warm student (`setup`): a tiny Llama (the quickstart's size) supervised on sloppy
answers of two tasks in one dataset, addition `a+b=` and subtraction `a-b=` (a `task` column; the carry or the
borrow forgotten in 60% of the problems that have one), and for half of the problems on the hinted prompt
`{answer}|{prompt}` answered right (the skill a pretrained model brings to reading a hint in its context).
Each task's teacher is that student supervised further on the task's correct answers only.

Rows:
- `multi`: on-policy distillation with both `teachers`, routed per row by `route_by: task`; held-out greedy
  accuracy of the student on each task before and after, and after the same run with the teachers swapped
  (every row sent to the other task's teacher: the control).
- `self`: self-distillation (`self_teacher`): the policy itself on `{answer}|{prompt}` is the teacher of its
  own samples from the plain prompt; held-out greedy accuracy on plain prompts before and after.
- `bound`: the single-teacher bar restated, on addition: the same warm student trained for the same steps
  and samples a step by full on-policy distillation from the addition teacher, and by supervised training on
  that teacher's own greedy answers (the supervised upper bound: the densest signal the student can get);
  held-out accuracy of both at the same steps.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

SIZE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}  # the quickstart's model
HINT = "{answer}|{prompt}"


def forgot_borrow(a: int, b: int) -> int:
    """`a - b` written digit by digit as the absolute difference (52-17 -> 45): the borrow forgotten."""
    return int("".join(str(abs(int(x) - int(y))) for x, y in zip(f"{a:02d}", f"{b:02d}", strict=True)))


def two_task_rows(n: int, seed: int, *, slip: float = 0.0, exclude: set[str] = frozenset()):
    """`n` rows, half addition and half subtraction (`a >= b`) of two-digit numbers, with `task`, `answer` and a
    `completion` that forgets the carry / borrow in `slip` of the problems that have one."""
    from datasets import Dataset

    from tokenmill.data.tasks import forgot_carry

    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "completion": [], "answer": [], "task": []}
    seen = set(exclude)
    while len(rows["prompt"]) < n:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        task = "add" if len(rows["prompt"]) % 2 == 0 else "sub"
        a, b = (a, b) if task == "add" or a >= b else (b, a)
        prompt = f"{a}{'+' if task == 'add' else '-'}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        right, wrong = (a + b, forgot_carry(a, b)) if task == "add" else (a - b, forgot_borrow(a, b))
        rows["prompt"].append(prompt)
        rows["answer"].append(str(right))
        rows["completion"].append(str(wrong if wrong != right and rng.random() < slip else right))
        rows["task"].append(task)
    return Dataset.from_dict(rows)


def exact_reward(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def supervised(path: Path, rows, steps: int, out: Path, *, lr: float = 1e-3, seed: int = 0,
               batch_size: int = 64) -> Path:
    """`path`'s model trained on `rows`' completions for `steps` steps, saved to `out`."""
    from tokenmill.config.schema import ModelConfig
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    model, tok = load_policy(ModelConfig(path=str(path)), resolve_device("cpu"))
    run_sft(model, tok, rows, steps=steps, batch_size=batch_size, learning_rate=lr, seed=seed, output_dir=out)
    return out


def fresh(work: Path, name: str, seed: int) -> Path:
    from tokenmill.recipes.tiny import build_tiny_model

    return Path(build_tiny_model(work / name, seed=seed, **SIZE))


@torch.no_grad()
def accuracy(path: Path, rows, *, template: str | None = None) -> dict[str, float]:
    """Greedy accuracy of a model folder on `rows`, per `task` (and `all`); prompts rendered by `template`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.rollout.generator import encode_prompts
    from tokenmill.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [template.format(**r) if template else r["prompt"] for r in rows]
    outs = HFEngine(model, tok).generate(encode_prompts(tok, prompts), SamplingParams(max_tokens=5, greedy=True))
    right: dict[str, list[float]] = {}
    for r, out in zip(rows, outs, strict=True):
        ok = float(tok.decode(out[0].token_ids, skip_special_tokens=True).strip() == r["answer"])
        for key in (r.get("task", "add"), "all"):
            right.setdefault(key, []).append(ok)
    return {k: round(sum(v) / len(v), 3) for k, v in right.items()}


def distill_run(student: Path, rows, out: Path, distillation: dict, *, steps: int, lr: float,
                prompts: int = 64, seed: int = 0) -> list[dict]:
    """On-policy distillation of `student` on `rows` (one sample per prompt); the run's metrics rows."""
    import tokenmill

    tokenmill.train({
        "model": {"path": str(student)},
        "generation": {"group_size": 1, "max_tokens": 5},
        "algorithm": {"advantage": "distill"},
        "distillation": distillation,
        "training": {"learning_rate": lr, "seed": seed},
        "controller": {"steps": steps, "prompts_per_step": prompts},
        "tracking": {"output_dir": str(out), "console": "none"},
        "checkpoint": {"every": 0, "save_final": True},
    }, rewards=[exact_reward], dataset=rows)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final(out: Path) -> Path:
    return out / "final"


def setup(work: Path, *, warm_steps: int = 1500, teacher_steps: int = 300, seed: int = 0) -> dict:
    """The shared pieces, built once in `work`: held-out and training rows of both tasks; the warm student,
    supervised `warm_steps` on sloppy answers of both tasks (the carry or borrow forgotten in 60% of the
    problems that have one) and, for half the problems, on the hinted prompt `{answer}|{prompt}` answered
    right (the skill of reading a hint in its context); and one teacher per task: the warm student supervised
    `teacher_steps` more on that task's correct answers only."""
    from datasets import concatenate_datasets

    held = two_task_rows(400, seed + 10_000)
    train = two_task_rows(6_000, seed, slip=0.6, exclude=set(held["prompt"]))
    clean = two_task_rows(6_000, seed + 1, exclude=set(held["prompt"]))
    warm = work / "student_warm"
    if not warm.exists():
        hinted = train.shuffle(seed=seed + 2).select(range(len(train) // 2)).map(
            lambda r: {"prompt": HINT.format(**r), "completion": r["answer"]})
        supervised(fresh(work, "student_base", seed), concatenate_datasets([train, hinted]).shuffle(seed=seed),
                   warm_steps, warm, seed=seed)
    teachers = {}
    for task in ("add", "sub"):
        teachers[task] = work / f"teacher_{task}"
        if not teachers[task].exists():
            supervised(warm, clean.filter(lambda r, t=task: r["task"] == t), teacher_steps, teachers[task],
                       seed=seed)
    return {"held": held, "train": train, "warm": warm, "teachers": teachers}


def multi_teacher(work: Path, *, steps: int = 60, lr: float = 1e-4, **kw) -> dict:
    """Two tasks, each routed to its own teacher (`route_by: task`); accuracy per task before and after."""
    s = setup(work, **kw)
    held, teachers = s["held"], s["teachers"]
    cross = {task: accuracy(path, held) for task, path in teachers.items()}
    before = accuracy(s["warm"], held)
    metrics = distill_run(s["warm"], s["train"], work / f"multi_{lr:g}", {
        "teachers": {t: {"path": str(p)} for t, p in teachers.items()}, "route_by": "task"}, steps=steps, lr=lr)
    after = accuracy(final(work / f"multi_{lr:g}"), held)
    kl = {t: [r[f"distill/reverse_kl/{t}"] for r in metrics if f"distill/reverse_kl/{t}" in r] for t in teachers}
    # the control: every row sent to the other task's teacher (`routes` swapped)
    distill_run(s["warm"], s["train"], work / f"swapped_{lr:g}", {
        "teachers": {t: {"path": str(p)} for t, p in teachers.items()}, "route_by": "task",
        "routes": {"add": "sub", "sub": "add"}}, steps=steps, lr=lr)
    return {"row": "multi", "teachers": cross, "before": before, "after": after, "steps": steps, "lr": lr,
            "after_with_teachers_swapped": accuracy(final(work / f"swapped_{lr:g}"), held),
            "reverse_kl_first_last_10": {t: ends(v) for t, v in kl.items()}}


def ends(values: list[float], n: int = 10) -> list[float]:
    """The mean of the first and of the last `n` values."""
    k = max(1, min(n, len(values)))
    return [round(sum(values[:k]) / k, 3), round(sum(values[-k:]) / k, 3)]


def self_distill(work: Path, *, steps: int = 60, lr: float = 1e-4, snapshot: str = "policy", **kw) -> dict:
    """The policy on `{answer}|{prompt}` as its own teacher, both tasks; accuracy on plain prompts."""
    s = setup(work, **kw)
    held = s["held"]
    before, with_hint = accuracy(s["warm"], held), accuracy(s["warm"], held, template=HINT)
    metrics = distill_run(s["warm"], s["train"], work / f"self_{lr:g}",
                          {"self_teacher": {"template": HINT, "snapshot": snapshot}}, steps=steps, lr=lr)
    kl = [r["distill/reverse_kl"] for r in metrics if "distill/reverse_kl" in r]
    return {"row": "self", "before": before, "after": accuracy(final(work / f"self_{lr:g}"), held),
            "teacher_side_before": with_hint, "steps": steps, "lr": lr, "snapshot": snapshot,
            "reverse_kl_first_last_10": ends(kl)}


def bound(work: Path, *, steps: tuple[int, ...] = (20, 60), prompts: int = 64, lr: float = 1e-4,
          sft_lr: float = 1e-3, **kw) -> dict:
    """Full on-policy distillation from the addition teacher against supervised training on that teacher's
    own greedy answers, both `prompts` samples a step for as many steps, from the same warm student, on
    addition, compared at each of `steps`."""
    s = setup(work, **kw)
    held = s["held"].filter(lambda r: r["task"] == "add")
    train = s["train"].filter(lambda r: r["task"] == "add")
    teacher, warm = s["teachers"]["add"], s["warm"]
    answers = teacher_answers(teacher, train)  # what the teacher says to every training prompt
    out = {"row": "bound", "teacher": accuracy(teacher, held)["all"], "before": accuracy(warm, held)["all"],
           "prompts_per_step": prompts, "distill_lr": lr, "sft_lr": sft_lr, "full": {}, "supervised": {}}
    for n in steps:
        run = work / f"full_{n}_{lr:g}"
        distill_run(warm, train, run, {"teacher": {"path": str(teacher)}, "loss": "full"}, steps=n, lr=lr,
                    prompts=prompts)
        out["full"][n] = accuracy(final(run), held)["all"]
        sft = supervised(warm, answers, n, work / f"sft_{n}_{sft_lr:g}", lr=sft_lr, batch_size=prompts)
        out["supervised"][n] = accuracy(sft, held)["all"]
    return out


@torch.no_grad()
def teacher_answers(teacher: Path, rows):
    """`rows` with `completion` set to the teacher's greedy answer to each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.rollout.generator import encode_prompts
    from tokenmill.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(teacher)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval(), tok)
    outs = engine.generate(encode_prompts(tok, list(rows["prompt"])), SamplingParams(max_tokens=5, greedy=True))
    said = [tok.decode(o[0].token_ids, skip_special_tokens=True).strip() for o in outs]
    return rows.add_column("teacher", said).map(lambda r: {"completion": r["teacher"]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="multi,self,bound", help="comma-separated rows")
    p.add_argument("--steps", type=int, default=60, help="distillation steps of the multi and self rows")
    p.add_argument("--bound-steps", default="20,60", help="steps at which the bound row compares")
    p.add_argument("--lr", type=float, default=1e-4, help="the distillation runs' learning rate")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="", help="folder for the models (default: a new temporary one)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="tokenmill_distill_"))
    rows = []
    for name in filter(None, args.only.split(",")):
        start = time.time()
        if name == "multi":
            row = multi_teacher(work, steps=args.steps, lr=args.lr)
        elif name == "self":
            row = self_distill(work, steps=args.steps, lr=args.lr)
        else:
            row = bound(work, steps=tuple(int(s) for s in args.bound_steps.split(",")), lr=args.lr)
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
