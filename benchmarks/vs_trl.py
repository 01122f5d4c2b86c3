"""tokenmill vs TRL's GRPOTrainer: the same tiny model, data and settings, one run, one machine.

    python benchmarks/vs_trl.py                 # 200 steps, 1000 held-out problems
    python benchmarks/vs_trl.py --quick         # 30 steps, 200 held-out problems (smoke test)
    python benchmarks/vs_trl.py --steps 1500 --out benchmarks/results/vs_trl_1500.json

The parent process builds the shared tiny model once (a random-init Llama with the character tokenizer, then a
short supervised warm start on the addition task; cached in --workdir), then runs each trainer in its own
child process (`vs_trl.py tokenmill|trl --spec ... --result ...`), so peak RSS is measured per trainer. Both
children use the same evaluation code (`tokenmill.controller.evaluate.evaluate`, greedy, outside the timed
region) before and after training.

Timed region = the training steps only:
  tokenmill: sum of `timing_s/step` from metrics.jsonl (sample prompts, generate, score, advantages, update,
             sync; the periodic logging and the evaluations are outside it)
  TRL:       sum over steps of on_step_begin -> on_step_end (generation, scoring, loss, backward, optimiser
             step; fetching the batch from the data loader and the per-step logging are outside it)
Tokens: generated = completion tokens sampled (EOS included, as both trainers train on it); trained =
generated + prompt tokens of every sequence (the sequences each trainer's update is given).

The rules this follows (the peer configured at its best, ratios reported) are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


# ------------------------------------------------------------------------------------------------ helpers


def peak_rss_mib() -> dict[str, float]:
    """Peak resident set size of this process (and of its largest reaped child), in MiB (Linux: KiB units)."""
    scale = 1024.0 if sys.platform != "darwin" else 1024.0 * 1024.0
    return {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / scale,
    }


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def cpu_busy_seconds() -> float:
    """CPU seconds all processes on the machine have been busy (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return float("nan")
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def load_meter() -> Iterator[dict[str, float]]:
    """Cores this process used, and cores *other* processes used, over a region (machine noise indicator)."""
    report: dict[str, float] = {}
    t0, busy0, own0 = time.perf_counter(), cpu_busy_seconds(), time.process_time()
    try:
        yield report
    finally:
        wall = max(time.perf_counter() - t0, 1e-9)
        own = time.process_time() - own0
        report["wall_s"] = wall
        report["own_cores"] = own / wall
        report["other_cores"] = max(0.0, (cpu_busy_seconds() - busy0 - own) / wall)


def step_stats(step_seconds: list[float]) -> dict[str, float]:
    """Median / min / max seconds per step with the first (warm-up) step excluded."""
    rest = step_seconds[1:] if len(step_seconds) > 1 else step_seconds
    return {
        "median": statistics.median(rest),
        "min": min(rest),
        "max": max(rest),
        "mean": statistics.fmean(rest),
        "first": step_seconds[0],
        "steps": len(step_seconds),
        "total": sum(step_seconds),
    }


def evaluate_model(model, tokenizer, eval_rows, max_rows: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy held-out accuracy with tokenmill's own evaluation (the one `tokenmill.train` runs)."""
    from tokenmill.controller.evaluate import evaluate
    from tokenmill.data.tasks import addition_reward
    from tokenmill.engines import HFEngine
    from tokenmill.rewards import FunctionReward, RewardSet
    from tokenmill.rollout import Generator
    from tokenmill.types import SamplingParams

    rewards = RewardSet([FunctionReward(addition_reward, isolation="thread")])
    try:
        generator = Generator(
            HFEngine(model, tokenizer), tokenizer, rewards, SamplingParams(max_tokens=max_new_tokens)
        )
        start = time.perf_counter()
        out = evaluate(generator, eval_rows, max_rows)
        out["eval/seconds"] = time.perf_counter() - start
        return out
    finally:
        rewards.close()


def train_reward_summary(rewards: list[float], k: int = 20) -> dict[str, float]:
    rewards = [r for r in rewards if r is not None]
    if not rewards:
        return {}
    k = min(k, len(rewards))
    return {
        "first_k_mean": statistics.fmean(rewards[:k]),
        "last_k_mean": statistics.fmean(rewards[-k:]),
        "k": k,
    }


# ----------------------------------------------------------------------------------------- tokenmill child


def tokenmill_config(spec: dict[str, Any], output_dir: str) -> dict[str, Any]:
    return {
        "model": {"path": spec["model_dir"], "dtype": "float32", "device": "cpu"},
        "data": {
            "task": "addition",
            "num_train": spec["num_train"],
            "num_eval": spec["num_eval"],
            "shuffle": True,
        },
        "generation": {
            "group_size": spec["group_size"],
            "max_tokens": spec["max_new_tokens"],
            "temperature": spec["temperature"],
            "top_p": 1.0,
            "top_k": 0,
        },
        "algorithm": {
            "advantage": "grpo",
            "scale_rewards": True,
            "loss": "ppo_clip",
            "clip_low": 0.2,
            "clip_high": 0.2,
            "loss_agg": "token_mean",
            "kl_coef": spec["beta"],
            "ppo_epochs": 1,
            "mini_batches": 1,
        },
        "training": {
            "learning_rate": spec["learning_rate"],
            "weight_decay": 0.0,
            "betas": [0.9, 0.999],
            "warmup_steps": 0,
            "lr_schedule": "constant",
            "max_grad_norm": spec["max_grad_norm"],
            "seed": spec["seed"],
        },
        "controller": {
            "steps": spec["steps"],
            "prompts_per_step": spec["prompts_per_step"],
            "eval_every": spec["eval_every"],
            "eval_max_rows": spec["eval_rows"],
        },
        "tracking": {"output_dir": output_dir, "console": "none", "log_samples": 2},
        "checkpoint": {"every": 0, "save_final": False},
    }


def child_tokenmill(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    import yaml
    from transformers import AutoTokenizer

    import tokenmill
    from tokenmill.data.prompts import PromptSource
    from tokenmill.data.registry import task_splits

    out_dir = Path(spec["workdir"]) / "tokenmill_run"
    if out_dir.exists():  # metrics.jsonl is opened in append mode: start clean
        for name in ("metrics.jsonl", "samples.jsonl", "config.yaml"):
            (out_dir / name).unlink(missing_ok=True)
    cfg = tokenmill_config(spec, str(out_dir))
    rss_before = current_rss_mib()
    wall_start = time.perf_counter()
    with load_meter() as load:
        result = tokenmill.train(cfg)
    wall = time.perf_counter() - wall_start

    records = [
        json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = [r for r in records if "timing_s/step" in r]
    assert len(steps) == spec["steps"], f"expected {spec['steps']} step records, found {len(steps)}"
    seqs = spec["prompts_per_step"] * spec["group_size"]
    step_s = [r["timing_s/step"] for r in steps]
    generated_per_step = [round(seqs * r["response_len/mean"]) for r in steps]

    # prompt tokens: replay the (seeded, deterministic) prompt order tokenmill drew
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    train_rows, _, _ = task_splits("addition", spec["num_train"], spec["num_eval"], seed=spec["seed"])
    source = PromptSource(train_rows, seed=spec["seed"], shuffle=True)
    prompt_tokens = 0
    for _ in steps:
        rows = source.next_rows(spec["prompts_per_step"])
        prompt_tokens += spec["group_size"] * sum(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    # cross-check: the train stage counts prompt + completion tokens of every trainable sample
    train_counted = sum(
        r["throughput/train_tok_s"] * r["timing_s/train"] for r in steps if "throughput/train_tok_s" in r
    )
    generated = sum(generated_per_step)
    curve, elapsed = [], 0.0
    for r in steps:
        elapsed += r["timing_s/step"]
        if "eval/accuracy" in r:
            curve.append({"step": r["step"], "train_seconds": elapsed, "accuracy": r["eval/accuracy"]})
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()[:8]]
    return {
        "trainer": "tokenmill",
        "version": tokenmill.__version__,
        "config": yaml.safe_load((out_dir / "config.yaml").read_text()),
        "step_seconds": step_s,
        "stage_seconds": {
            stage: sum(r.get(f"timing_s/{stage}", 0.0) for r in steps)
            for stage in ("generate", "reward", "train", "sync")
        },
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "trained_tokens": generated + prompt_tokens,
        "trained_tokens_counted_by_tokenmill": round(train_counted),
        "sequences_trained_forward": sum(r.get("train/sequences_trained", 0) for r in steps),
        "train_reward": [r.get("reward/mean") for r in steps],
        "eval_before": result.get("eval_before"),
        "eval_after": result.get("eval_after"),
        "eval_curve": curve,
        "wall_seconds_train_call": wall,
        "cpu_load_train_call": load,
        "rss_before_train_mib": rss_before,
        "torch_threads": torch.get_num_threads(),
        "sample_completions": [(s["prompt"], s["completion"], s["reward"]) for s in samples],
    }


# ---------------------------------------------------------------------------------------------- TRL child


def trl_args(spec: dict[str, Any], output_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        # the same work
        per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],  # counts completions
        num_generations=spec["group_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=1,  # one optimiser step per generation batch
        num_iterations=1,
        max_steps=spec["steps"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=spec["max_grad_norm"],
        beta=spec["beta"],
        epsilon=0.2,
        loss_type="dapo",  # token mean over the batch = tokenmill's loss_agg token_mean
        scale_rewards="group",  # (r - mean) / (std + 1e-4) within each group = tokenmill's grpo advantage
        mask_truncated_completions=False,
        seed=spec["seed"],
        data_seed=spec["seed"],
        # at its best on CPU (docs/benchmarks.md, "How comparisons are run")
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=True,
        dataloader_num_workers=0,
        # logging every step, no console printout, no saving, no in-training eval
        logging_steps=1,
        disable_tqdm=True,
        report_to="none",
        log_completions=False,
        save_strategy="no",
        eval_strategy="no",
        remove_unused_columns=False,
    )


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from tokenmill.data.registry import task_splits
    from tokenmill.data.tasks import addition_reward

    train_rows, eval_rows, _ = task_splits("addition", spec["num_train"], spec["num_eval"], seed=spec["seed"])
    train_ds = train_rows.select_columns(["prompt", "answer"])  # plain-string prompts + the reward's column

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    eval_before = evaluate_model(model, tokenizer, eval_rows, spec["eval_rows"], spec["max_new_tokens"])

    seen: dict[str, Any] = {"generated": 0, "calls": 0, "rewards": [], "samples": []}

    def addition_exact(prompts, completions, answer, completion_ids=None, **kwargs):
        """tokenmill's addition_reward (exact match), counting the generated tokens TRL hands it."""
        scores = addition_reward(prompts, completions, answer)
        seen["calls"] += 1
        if completion_ids is not None:
            seen["generated"] += sum(len(ids) for ids in completion_ids)
        seen["rewards"].append(statistics.fmean(scores))
        if len(seen["samples"]) < 8:
            seen["samples"].extend(
                list(zip(prompts, completions, scores, strict=True))[: 8 - len(seen["samples"])]
            )
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            self.generated_per_step: list[int] = []
            self.logs: list[dict[str, Any]] = []
            self.curve: list[dict[str, Any]] = []
            self.threads_seen: set[int] = set()
            self._t0 = 0.0
            self._g0 = 0
            self.train_begin = self.train_end = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._g0 = seen["generated"]
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.step_seconds.append(time.perf_counter() - self._t0)
            self.generated_per_step.append(seen["generated"] - self._g0)
            self.threads_seen.add(torch.get_num_threads())
            if spec["eval_every"] and state.global_step % spec["eval_every"] == 0:  # outside the timed region
                acc = evaluate_model(model, tokenizer, eval_rows, spec["eval_rows"], spec["max_new_tokens"])
                self.curve.append(
                    {
                        "step": state.global_step,
                        "train_seconds": sum(self.step_seconds),
                        "accuracy": acc["eval/accuracy"],
                    }
                )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append(dict(logs))

        def on_train_end(self, args, state, control, **kwargs):
            self.train_end = time.perf_counter()

    timer = StepTimer()
    out_dir = Path(spec["workdir"]) / "trl_run"
    args = trl_args(spec, str(out_dir))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[addition_exact],
        args=args,
        train_dataset=train_ds,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the bar for a per-step print: keep it quiet
    rss_before = current_rss_mib()
    wall_start = time.perf_counter()
    with load_meter() as load:
        trainer.train()
    wall = time.perf_counter() - wall_start

    trained_model = trainer.accelerator.unwrap_model(trainer.model)
    eval_after = evaluate_model(
        trained_model, tokenizer, eval_rows, spec["eval_rows"], spec["max_new_tokens"]
    )

    step_logs = [entry for entry in timer.logs if "completions/mean_length" in entry]
    seqs = spec["prompts_per_step"] * spec["group_size"]
    generated_from_logs = sum(round(seqs * entry["completions/mean_length"]) for entry in step_logs)
    generated = sum(timer.generated_per_step) if seen["generated"] else generated_from_logs
    inner_opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    trained = int(trainer.state.num_input_tokens_seen)  # prompt + completion tokens of every sequence
    assert len(timer.step_seconds) == spec["steps"], (len(timer.step_seconds), spec["steps"])
    if not any(seen["rewards"]):
        print("WARNING: TRL's reward was 0 on every step: check the decoded completions", flush=True)
    return {
        "trainer": "trl",
        "version": trl.__version__,
        "config": {k: v for k, v in args.to_dict().items() if not k.startswith("_")},
        "optimizer": type(inner_opt).__name__,
        "optimizer_param_groups": [
            {
                k: v
                for k, v in g.items()
                if k != "params" and isinstance(v, (int, float, bool, tuple, list, type(None)))
            }
            | {"num_params": len(g["params"])}
            for g in inner_opt.param_groups
        ],
        "step_seconds": timer.step_seconds,
        "generated_tokens": generated,
        "generated_tokens_from_logs": generated_from_logs,
        "prompt_tokens": trained - generated,
        "trained_tokens": trained,
        "train_reward": [entry.get("reward") for entry in step_logs],
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_curve": timer.curve,
        "torch_threads": sorted(timer.threads_seen),
        "wall_seconds_train_call": wall,
        "cpu_load_train_call": load,
        "wall_seconds_train_loop": timer.train_end - timer.train_begin,
        "rss_before_train_mib": rss_before,
        "sample_completions": seen["samples"],
    }


def run_child(kind: str, spec_path: Path, result_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fn = {"tokenmill": child_tokenmill, "trl": child_trl}[kind]
    result = fn(spec)
    result["peak_rss_mib"] = peak_rss_mib()
    result["rss_end_mib"] = current_rss_mib()
    result_path.write_text(json.dumps(result, indent=1, default=str))


# ------------------------------------------------------------------------------------------ parent process


def prepare_model(spec: dict[str, Any], sft_steps: int, rebuild: bool) -> dict[str, Any]:
    """Random-init tiny Llama + character tokenizer, then a supervised warm start; cached by its settings."""
    model_dir = Path(spec["model_dir"])
    stamp = model_dir / "warm_start.json"
    wanted = {
        "hidden_size": spec["hidden_size"],
        "num_layers": spec["num_layers"],
        "sft_steps": sft_steps,
        "slip": spec["slip"],
        "seed": spec["seed"],
        "num_train": spec["num_train"],
        "num_eval": spec["num_eval"],
    }
    if not rebuild and stamp.exists() and json.loads(stamp.read_text()).get("settings") == wanted:
        print(f"reusing warm-started model {model_dir}", flush=True)
        return json.loads(stamp.read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.data.registry import task_splits
    from tokenmill.testing import build_tiny_model
    from tokenmill.training.sft import run_sft

    base = Path(spec["workdir"]) / "base_model"
    build_tiny_model(base, hidden_size=spec["hidden_size"], num_layers=spec["num_layers"], seed=spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the quickstart's warm start: a sloppy teacher forgets the carry in `slip` of the carry problems
    rows, _, _ = task_splits("addition", spec["num_train"], spec["num_eval"], seed=spec["seed"], slip=spec["slip"])
    print(f"supervised warm start: {sft_steps} steps on {len(rows)} addition rows (slip {spec['slip']}) ...",
          flush=True)
    start = time.perf_counter()
    losses = run_sft(model, tokenizer, rows, steps=sft_steps, seed=spec["seed"], output_dir=model_dir)
    info = {
        "settings": wanted,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_seconds": time.perf_counter() - start,
        "sft_final_nll": losses[-1],
    }
    stamp.write_text(json.dumps(info, indent=1))
    print(f"warm start done in {info['sft_seconds']:.0f}s, final nll {losses[-1]:.3f}", flush=True)
    return info


def launch(kind: str, spec_path: Path, workdir: Path) -> dict[str, Any]:
    result_path = workdir / f"result_{kind}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE), kind, "--spec", str(spec_path), "--result", str(result_path)]
    print(f"\n=== {kind}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 or not result_path.exists():
        raise SystemExit(f"{kind} child failed with exit code {proc.returncode}")
    result = json.loads(result_path.read_text())
    result["wall_seconds_process"] = time.perf_counter() - start
    return result


def summarise(r: dict[str, Any]) -> dict[str, Any]:
    st = step_stats(r["step_seconds"])
    total = st["total"]
    return {
        "s_per_step_median": st["median"],
        "s_per_step_min": st["min"],
        "s_per_step_max": st["max"],
        "s_per_step_mean": st["mean"],
        "first_step_s": st["first"],
        "steps": st["steps"],
        "train_seconds": total,
        "generated_tokens": r["generated_tokens"],
        "trained_tokens": r["trained_tokens"],
        "generated_tok_s": r["generated_tokens"] / total,
        "trained_tok_s": r["trained_tokens"] / total,
        "peak_rss_mib": r["peak_rss_mib"]["self"],
        "eval_acc_before": r["eval_before"]["eval/accuracy"],
        "eval_acc_after": r["eval_after"]["eval/accuracy"],
        "eval_rows": r["eval_after"]["eval/rows"],
        "train_reward": train_reward_summary(r["train_reward"]),
    }


def full_curve(r: dict[str, Any]) -> list[dict[str, Any]]:
    """(step, cumulative training seconds, held-out accuracy): before, every --eval-every steps, after."""
    curve = [{"step": 0, "train_seconds": 0.0, "accuracy": r["eval_before"]["eval/accuracy"]}]
    curve += [c for c in r.get("eval_curve", []) if c["step"] < len(r["step_seconds"])]
    curve.append(
        {
            "step": len(r["step_seconds"]),
            "train_seconds": sum(r["step_seconds"]),
            "accuracy": r["eval_after"]["eval/accuracy"],
        }
    )
    return curve


def time_to_accuracy(curve: list[dict[str, Any]], target: float) -> float | None:
    for point in curve:
        if point["accuracy"] >= target:
            return point["train_seconds"]
    return None


ROWS = [
    ("s/step median (excl. 1st)", "s_per_step_median", "{:.4f}", True),
    ("s/step min", "s_per_step_min", "{:.4f}", True),
    ("s/step max", "s_per_step_max", "{:.4f}", True),
    ("first step s", "first_step_s", "{:.3f}", True),
    ("train wall s (sum of steps)", "train_seconds", "{:.1f}", True),
    ("generated tokens", "generated_tokens", "{:d}", True),
    ("trained tokens", "trained_tokens", "{:d}", True),
    ("generated tok/s (e2e)", "generated_tok_s", "{:.0f}", True),
    ("trained tok/s (e2e)", "trained_tok_s", "{:.0f}", True),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}", True),
    ("held-out acc before", "eval_acc_before", "{:.3f}", False),
    ("held-out acc after", "eval_acc_after", "{:.3f}", True),
]


def config_pairs(spec: dict[str, Any], tm: dict[str, Any], tr: dict[str, Any]) -> list[tuple[str, str, str]]:
    c, a = tm["config"], tr["config"]
    g, t, al, ct = c["generation"], c["training"], c["algorithm"], c["controller"]
    return [
        ("model folder", f"model.path={c['model']['path']}", f"model=from_pretrained({spec['model_dir']})"),
        (
            "precision",
            f"model.dtype={c['model']['dtype']} device={c['model']['device']}",
            f"bf16={a['bf16']} fp16={a['fp16']} use_cpu={a['use_cpu']}",
        ),
        (
            "prompts per step",
            f"controller.prompts_per_step={ct['prompts_per_step']}",
            f"per_device_train_batch_size={a['per_device_train_batch_size']} / num_generations",
        ),
        ("group size", f"generation.group_size={g['group_size']}", f"num_generations={a['num_generations']}"),
        (
            "max new tokens",
            f"generation.max_tokens={g['max_tokens']}",
            f"max_completion_length={a['max_completion_length']}",
        ),
        (
            "sampling",
            f"temperature={g['temperature']} top_p={g['top_p']} top_k={g['top_k']}",
            f"temperature={a['temperature']} top_p={a['top_p']} top_k={a['top_k']}",
        ),
        ("steps", f"controller.steps={ct['steps']}", f"max_steps={a['max_steps']}"),
        (
            "optimiser steps per batch",
            f"ppo_epochs={al['ppo_epochs']} mini_batches={al['mini_batches']}",
            (
                f"num_iterations={a['num_iterations']} steps_per_generation={a['steps_per_generation']} "
                f"grad_accum={a['gradient_accumulation_steps']}"
            ),
        ),
        (
            "optimizer",
            f"AdamW(foreach) betas={tuple(t['betas'])} wd={t['weight_decay']}",
            f"{a['optim']} betas=({a['adam_beta1']}, {a['adam_beta2']}) wd={a['weight_decay']} eps={a['adam_epsilon']}",
        ),
        (
            "learning rate",
            f"{t['learning_rate']} {t['lr_schedule']} warmup={t['warmup_steps']}",
            f"{a['learning_rate']} {a['lr_scheduler_type']} warmup={a['warmup_steps']}",
        ),
        ("grad clip", f"max_grad_norm={t['max_grad_norm']}", f"max_grad_norm={a['max_grad_norm']}"),
        ("KL", f"kl_coef={al['kl_coef']}", f"beta={a['beta']}"),
        (
            "loss",
            f"{al['loss']} clip={al['clip_low']}/{al['clip_high']} agg={al['loss_agg']}",
            f"loss_type={a['loss_type']} epsilon={a['epsilon']} epsilon_high={a['epsilon_high']}",
        ),
        (
            "advantage",
            f"{al['advantage']} scale_rewards={al['scale_rewards']}",
            f"scale_rewards={a['scale_rewards']}",
        ),
        ("gradient checkpointing", "no", f"gradient_checkpointing={a['gradient_checkpointing']}"),
        (
            "generation backend",
            "HFEngine (in-process, KV cache)",
            f"model.generate (use_vllm={a['use_vllm']})",
        ),
        ("reward", "built-in addition task (exact match)", "tokenmill addition_reward (exact match)"),
        ("seed", f"{t['seed']}", f"seed={a['seed']} data_seed={a['data_seed']}"),
        (
            "logging",
            f"console={c['tracking']['console']}, metrics.jsonl every step",
            f"logging_steps={a['logging_steps']} report_to={a['report_to']} disable_tqdm={a['disable_tqdm']}",
        ),
    ]


def print_report(spec, report) -> None:
    tm, tr = report["tokenmill"], report["trl"]
    print("\n" + "=" * 110)
    print(
        f"tokenmill {tm['version']} vs TRL {tr['version']} GRPOTrainer | model: hidden {spec['hidden_size']}, "
        f"{spec['num_layers']} layers, {report['model']['parameters']:,} params | torch threads {spec['threads']} | "
        f"{report['machine']['cpus']} CPUs"
    )
    print("=" * 110)
    pairs = config_pairs(spec, tm, tr)
    w0 = max(len(p[0]) for p in pairs)
    w1 = max(len(p[1]) for p in pairs)
    print(f"{'setting':<{w0}}  {'tokenmill':<{w1}}  TRL")
    for name, left, right in pairs:
        print(f"{name:<{w0}}  {left:<{w1}}  {right}")

    s_tm, s_tr = report["summary"]["tokenmill"], report["summary"]["trl"]
    print()
    print(f"{'metric':<30} {'tokenmill':>12} {'TRL':>12} {'tokenmill/TRL':>14}")
    print("-" * 71)
    for label, key, fmt, ratio in ROWS:
        a, b = s_tm[key], s_tr[key]
        r = f"{a / b:.2f}x" if ratio and b else ""
        print(f"{label:<30} {fmt.format(a):>12} {fmt.format(b):>12} {r:>14}")
    for name, s in (("tokenmill", s_tm), ("TRL", s_tr)):
        rw = s["train_reward"]
        if rw:
            print(
                f"train reward ({name}): first {rw['k']} steps {rw['first_k_mean']:.3f} -> last {rw['k']} "
                f"steps {rw['last_k_mean']:.3f}"
            )
    tta = report["summary"].get("time_to_accuracy")
    if tta:

        def fmt(v: float | None) -> str:
            return "not reached" if v is None else f"{v:.1f}s"

        ratio = report["ratios"].get("time_to_accuracy")
        if tta["target"] <= s_tm["eval_acc_before"]:
            print(
                f"(neither run's best held-out accuracy after the start, {tta['target']:.3f}, beat the start: "
                "time-to-accuracy below is not meaningful)"
            )
        print(
            f"time to held-out acc >= {tta['target']:.3f} (training seconds, eval every {spec['eval_every']} "
            f"steps): tokenmill {fmt(tta['tokenmill'])}, TRL {fmt(tta['trl'])}"
            + (f", ratio {ratio:.2f}x" if ratio else "")
        )
    print(
        f"held-out problems: {s_tm['eval_rows']} (greedy, same evaluate() for both, outside the timed region)"
    )
    stages = tm.get("stage_seconds", {})
    if stages:
        total = s_tm["train_seconds"]
        parts = ", ".join(f"{k} {v:.1f}s ({v / total:.0%})" for k, v in stages.items())
        print(f"tokenmill stages: {parts}")
    print(
        f"TRL loop wall (train_begin->train_end) {tr['wall_seconds_train_loop']:.1f}s vs sum of steps "
        f"{s_tr['train_seconds']:.1f}s; process wall: tokenmill {tm['wall_seconds_process']:.0f}s, "
        f"TRL {tr['wall_seconds_process']:.0f}s"
    )
    lt, lr_ = tm["cpu_load_train_call"], tr["cpu_load_train_call"]
    print(
        f"machine load during train() (cores of {report['machine']['cpus']}): tokenmill itself "
        f"{lt['own_cores']:.2f}, other processes {lt['other_cores']:.2f} | TRL itself {lr_['own_cores']:.2f}, "
        f"other processes {lr_['other_cores']:.2f}"
    )
    busy = max(lt["other_cores"], lr_["other_cores"])
    if busy > 0.25:
        print(
            f"WARNING: other processes used up to {busy:.2f} cores while a trainer ran: the timings above measure "
            f"that contention as much as the trainers (with {spec['threads']} torch threads on "
            f"{report['machine']['cpus']} cores a busy core stalls every parallel op); rerun on a quiet machine "
            "or with --threads 1"
        )
    print(
        f"torch threads: tokenmill {tm.get('torch_threads')}, TRL {tr.get('torch_threads')}; tokenmill's forked "
        f"reward worker peak RSS {tm['peak_rss_mib']['children']:.0f} MiB (not in its peak RSS above; mostly "
        f"pages shared with the parent)"
    )
    print("sample completions  tokenmill:", [(p, c, r) for p, c, r in tm["sample_completions"][:4]])
    print("sample completions  TRL:      ", [(p, c, r) for p, c, r in tr["sample_completions"][:4]])
    ratios = report["ratios"]
    print(
        f"\nVERDICT: tokenmill/TRL end-to-end generated tok/s = {ratios['generated_tok_s']:.2f}x, "
        f"median s/step = {ratios['s_per_step_median']:.2f}x, peak RSS = {ratios['peak_rss_mib']:.2f}x, "
        f"held-out acc after {s_tm['eval_acc_after']:.3f} vs {s_tr['eval_acc_after']:.3f} "
        f"(both from {s_tm['eval_acc_before']:.3f})"
    )


def run_parent(args: argparse.Namespace) -> None:
    if args.quick:
        args.steps = args.steps or 30
        args.eval_rows = args.eval_rows or 200
    steps = args.steps or 200
    eval_rows = args.eval_rows or 1000
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "workdir": str(workdir),
        "model_dir": str(
            workdir / f"warm_h{args.hidden}_l{args.layers}_sft{args.sft_steps}_slip{args.slip}_s{args.seed}"
        ),
        "slip": args.slip,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_train": 20000,
        "num_eval": 1000,
        "eval_rows": eval_rows,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "learning_rate": args.lr,
        "max_grad_norm": 1.0,
        "beta": 0.0,
        "steps": steps,
        "seed": args.seed,
        "threads": args.threads,
        "eval_every": args.eval_every,
    }
    if eval_rows > spec["num_eval"]:
        raise SystemExit(f"--eval-rows {eval_rows} exceeds the {spec['num_eval']} held-out problems")
    model_info = prepare_model(spec, args.sft_steps, args.rebuild)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))

    results = {kind: launch(kind, spec_path, workdir) for kind in args.order.split(",")}
    tm, tr = results["tokenmill"], results["trl"]
    summary = {"tokenmill": summarise(tm), "trl": summarise(tr)}
    keys = [
        "s_per_step_median",
        "s_per_step_min",
        "s_per_step_max",
        "train_seconds",
        "generated_tok_s",
        "trained_tok_s",
        "peak_rss_mib",
        "eval_acc_after",
    ]
    ratios = {k: summary["tokenmill"][k] / summary["trl"][k] if summary["trl"][k] else None for k in keys}
    curves = {"tokenmill": full_curve(tm), "trl": full_curve(tr)}
    if args.eval_every:
        target = args.target_acc
        if target is None:  # the lower of the two best accuracies reached after the start
            target = min(max(c["accuracy"] for c in curves[k] if c["step"] > 0) for k in curves)
        tta = {k: time_to_accuracy(curves[k], target) for k in curves}
        summary["time_to_accuracy"] = {"target": target, **tta}
        if tta["tokenmill"] is not None and tta["trl"]:
            ratios["time_to_accuracy"] = tta["tokenmill"] / tta["trl"]
    report = {
        "spec": spec,
        "model": model_info,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "summary": summary,
        "ratios": ratios,
        "eval_curves": curves,
        "tokenmill": tm,
        "trl": tr,
    }
    try:
        import torch
        import transformers

        report["machine"]["torch"] = torch.__version__
        report["machine"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    print_report(spec, report)
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"results written to {out}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("tokenmill", "trl"):
        child = argparse.ArgumentParser(prog=f"vs_trl.py {argv[0]}")
        child.add_argument("--spec", required=True, type=Path)
        child.add_argument("--result", required=True, type=Path)
        a = child.parse_args(argv[1:])
        run_child(argv[0], a.spec, a.result)
        return
    if argv and argv[0] == "run":
        argv = argv[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--steps", type=int, default=None, help="training steps for both (default 200; 30 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 30 steps, 200 held-out problems")
    p.add_argument(
        "--eval-rows", type=int, default=None, help="held-out problems (default 1000; 200 with --quick)"
    )
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny model")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny model")
    p.add_argument("--sft-steps", type=int, default=700, help="supervised warm-start steps (batch 64)")
    p.add_argument(
        "--slip", type=float, default=0.6,
        help="share of carry problems whose warm-start demonstration forgets the carry (as the quickstart)",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (16 = the quickstart)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate every N steps (outside the timed region) for time-to-accuracy; 0 = off",
    )
    p.add_argument(
        "--target-acc",
        type=float,
        default=None,
        help="accuracy for the time-to-accuracy row (default: the lower of the two best accuracies)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    p.add_argument("--order", default="tokenmill,trl", help="order the children run in")
    p.add_argument(
        "--workdir", default="/tmp/tokenmill_vs_trl", help="models and run folders (warm start cached)"
    )
    p.add_argument("--rebuild", action="store_true", help="rebuild the warm-started model even if cached")
    p.add_argument("--out", default="benchmarks/results/vs_trl.json", help="JSON results path")
    args = p.parse_args(argv)
    if sorted(args.order.split(",")) != ["tokenmill", "trl"]:
        p.error("--order must name tokenmill and trl once each")
    run_parent(args)


if __name__ == "__main__":
    main()
