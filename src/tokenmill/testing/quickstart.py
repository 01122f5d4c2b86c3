"""The quickstart recipe as a function: tiny model -> supervised warm start -> GRPO on addition.

`tokenmill quickstart` calls it with its defaults; the e2e test calls it smaller. The warm start learns from a
sloppy teacher who forgets the carry in `slip` of the problems that have one, so the warm model can add but
often prefers the slip; GRPO with the exact-match verifier (which always checks the true sum) must fix that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def warm_start(
    output_dir: str | Path, *, sft_steps: int = 700, slip: float = 0.6, num_eval: int = 1000, seed: int = 0,
    say: Callable[[str], None] = print,
) -> Path:
    """Build the tiny model and give it the sloppy teacher's supervised warm start; return the warm folder."""
    from tokenmill.config.schema import ModelConfig
    from tokenmill.controller.setup import load_policy, resolve_device
    from tokenmill.testing.tasks import task_splits
    from tokenmill.testing.tiny import build_tiny_model
    from tokenmill.training.sft import run_sft

    out = Path(output_dir)
    t0 = time.time()
    base = build_tiny_model(out / "base", seed=seed, **MODEL)
    say(f"[1/3] built a tiny Llama ({MODEL}) and a character tokenizer in {base}")
    train_rows, _, _ = task_splits("addition", 20000, num_eval, seed=seed, slip=slip)
    model, tok = load_policy(ModelConfig(path=base), resolve_device("cpu"))
    losses = run_sft(model, tok, train_rows, steps=sft_steps, batch_size=64, learning_rate=1e-3, seed=seed,
                     output_dir=out / "warm")
    say(f"[2/3] supervised warm start on a sloppy teacher's answers (carry forgotten in {slip:.0%} of carry "
        f"problems): {sft_steps} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f} ({time.time() - t0:.0f}s)")
    return out / "warm"


def grpo(
    warm: str | Path,
    output_dir: str | Path,
    *,
    steps: int = 200,
    learning_rate: float = 5e-5,
    prompts_per_step: int = 16,
    group_size: int = 8,
    num_eval: int = 1000,
    eval_every: int = 50,
    seed: int = 0,
    console: str = "plain",
    say: Callable[[str], None] = print,
    **overrides: Any,
) -> dict[str, Any]:
    """GRPO on addition from a warm model; `overrides` are dotted config keys (`model.lora.rank=8`)."""
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    out = Path(output_dir)
    cfg = load_config(RLConfig, {
        "model": {"path": str(warm)},
        "data": {"task": "addition", "num_eval": num_eval},
        "generation": {"group_size": group_size, "max_tokens": 6, "temperature": 1.0},
        "algorithm": {"advantage": "grpo"},
        "training": {"learning_rate": learning_rate, "seed": seed},
        "controller": {"steps": steps, "prompts_per_step": prompts_per_step, "eval_every": eval_every,
                       "eval_max_rows": num_eval},
        "tracking": {"output_dir": str(out), "console": console, "log_every": 10},
        "checkpoint": {"every": 0},
    }, overrides)
    say(f"[3/3] GRPO: {steps} steps x {prompts_per_step} prompts x {group_size} samples, "
        f"metrics in {out / 'metrics.jsonl'}")
    run = build_run(cfg)
    try:
        return run_rl(run)
    finally:
        run.close()


def quickstart(
    output_dir: str | Path,
    *,
    steps: int = 200,
    sft_steps: int = 700,
    learning_rate: float = 5e-5,
    prompts_per_step: int = 16,
    group_size: int = 8,
    slip: float = 0.6,
    num_eval: int = 1000,
    eval_every: int = 50,
    seed: int = 0,
    console: str = "plain",
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the whole recipe; return `run_rl`'s result (eval_before, eval_after, last_metrics, seconds)."""
    t0 = time.time()
    out = Path(output_dir)
    warm = warm_start(out, sft_steps=sft_steps, slip=slip, num_eval=num_eval, seed=seed, say=say)
    result = grpo(warm, out / "grpo", steps=steps, learning_rate=learning_rate, prompts_per_step=prompts_per_step,
                  group_size=group_size, num_eval=num_eval, eval_every=eval_every, seed=seed, console=console,
                  say=say)
    result["seconds"] = time.time() - t0
    return result
