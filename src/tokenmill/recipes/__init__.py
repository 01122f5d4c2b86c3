"""Recipes as functions: the quickstart (tiny model -> supervised warm start -> GRPO on addition), RLHF
(SFT -> reward model -> PPO) and the guess-the-number game runs (GRPO on env episodes, proxy mode).

`tokenmill quickstart` calls `quickstart` with its defaults; the e2e tests and benchmarks call them smaller. The warm start learns from a
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
    say: Callable[[str], None] = print, chat: bool = False,
) -> Path:
    """Build the tiny model and give it the sloppy teacher's supervised warm start; return the warm folder.
    `chat`: each prompt is a user message under the chat template (for agent programs that speak the chat API,
    e.g. a verifiers environment) instead of plain text."""
    from tokenmill.config.schema import ModelConfig
    from tokenmill.data.registry import task_splits
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    out = Path(output_dir)
    t0 = time.time()
    base = build_tiny_model(out / "base", seed=seed, **MODEL)
    say(f"[1/3] built a tiny Llama ({MODEL}) and a character tokenizer in {base}")
    train_rows, _, _ = task_splits("addition", 20000, num_eval, seed=seed, slip=slip)
    if chat:
        train_rows = train_rows.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})
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


# PPO against a learned reward model alone: the task's verifier only measures (weight 0). A stronger KL and a
# warmed-up critic keep the policy where the reward model is right.
PPO_RM = {
    "algorithm.advantage": "gae", "generation.group_size": 1, "prompts_per_step": 128, "algorithm.kl_coef": 0.2,
    "algorithm.kl_in_reward": True, "critic.warmup_steps": 20, "critic.learning_rate": 1e-3,
    "data.task_reward_weight": 0.0,
}


def rlhf(
    warm: str | Path, output_dir: str | Path, *, rm_steps: int = 2000, steps: int = 150, seed: int = 0,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """SFT -> reward model -> PPO: a Bradley-Terry reward model trained from the warm (SFT) model on preference
    pairs, then PPO with a critic against that reward model alone. Returns `run_rl`'s result plus the reward
    model's held-out pairwise accuracy (`rm_accuracy`); the eval reports `eval/reward/rm` (its score) and
    `eval/accuracy` (the hidden rule it was trained to stand for).

    The rejected answers mix the slip with other wrong numbers: a reward model that only ever saw slips scores
    unseen wrong answers at random, and PPO finds those at once (reward hacking).
    """
    from tokenmill.data.registry import HELD_OUT_SEED_OFFSET
    from tokenmill.data.tasks import addition_preferences
    from tokenmill.training import preference as pref

    out = Path(output_dir)
    held = addition_preferences(400, seed=HELD_OUT_SEED_OFFSET, other_wrong=0.5)
    train = addition_preferences(5000, seed=seed, exclude=set(held["prompt"]), other_wrong=0.5)
    model, tok = pref.load_reward_model_for_training(warm, seed=seed)
    pref.run_reward_model(model, tok, train, steps=rm_steps, learning_rate=5e-4, seed=seed, output_dir=out / "rm")
    accuracy = pref.pairwise_accuracy(model, tok, held)
    say(f"reward model: held-out pairwise accuracy {accuracy:.3f}")
    result = grpo(warm, out / "ppo", steps=steps, num_eval=500, eval_every=0, console="none", seed=seed, say=say,
                  rewards=[{"path": str(out / "rm")}], **PPO_RM)
    return result | {"rm_accuracy": accuracy}


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


def game_warm_start(
    output_dir: str | Path, *, sft_steps: int = 300, bisect: float = 0.3, games: int = 4000, seed: int = 0,
    say: Callable[[str], None] = print,
) -> Path:
    """The tiny model, then SFT on played guess-the-number games (chat data, assistant turns trained, packed):
    a player who halves the interval with probability `bisect` and otherwise counts up from the lowest
    allowed number. Returns the warm folder."""
    import random

    from datasets import Dataset

    from tokenmill.config.schema import ModelConfig
    from tokenmill.envs.guess import guess_demonstration
    from tokenmill.recipes.tiny import build_tiny_model
    from tokenmill.training.model import load_policy, resolve_device
    from tokenmill.training.sft import run_sft

    out = Path(output_dir)
    base = build_tiny_model(out / "base", seed=seed, **MODEL)
    rng = random.Random(seed)
    chats = [guess_demonstration(rng.randint(1, 7), 7, 3, rng, bisect) for _ in range(games)]
    model, tok = load_policy(ModelConfig(path=base), resolve_device("cpu"))
    losses = run_sft(model, tok, Dataset.from_dict({"messages": chats}), steps=sft_steps, batch_size=64,
                     learning_rate=1e-3, seed=seed, messages_column="messages", packing=True,
                     micro_batch_tokens=2048, output_dir=out / "warm")
    say(f"warm start on {games} played games (halving with p={bisect}): {sft_steps} steps, loss "
        f"{losses[0]:.2f} -> {losses[-1]:.2f}")
    return out / "warm"


def game_grpo(
    warm: str | Path, output_dir: str | Path, *, steps: int = 100, learning_rate: float = 5e-5,
    prompts_per_step: int = 16, group_size: int = 8, num_eval: int = 200, seed: int = 0, console: str = "none",
    **overrides: Any,
) -> dict[str, Any]:
    """GRPO on guess-the-number episodes (3 turns, 1-7) from a warm model."""
    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    cfg = load_config(RLConfig, {
        "model": {"path": str(warm)},
        "data": {"task": "guess_number", "num_train": 5000, "num_eval": num_eval},
        "env": {"name": "guess_number", "max_turns": 3, "max_episode_tokens": 64},
        "generation": {"group_size": group_size, "max_tokens": 4, "temperature": 1.0},
        "training": {"learning_rate": learning_rate, "seed": seed},
        "controller": {"steps": steps, "prompts_per_step": prompts_per_step, "eval_max_rows": num_eval},
        "tracking": {"output_dir": str(output_dir), "console": console, "log_every": 10},
        "checkpoint": {"every": 0},
    }, overrides)
    run = build_run(cfg)
    try:
        return run_rl(run)
    finally:
        run.close()


def game_proxy(
    warm: str | Path, output_dir: str | Path, agent_command: list[str], *, steps: int = 40,
    prompts_per_step: int = 8, group_size: int = 8, learning_rate: float = 5e-5, num_eval: int = 200,
) -> dict[str, Any]:
    """Proxy mode on guess-the-number: `agent_command` (an OpenAI-SDK program; '{url}' becomes the endpoint)
    plays against the served policy and posts rewards; the run trains on its episodes. Returns
    `run_rl`'s result plus the agent's own success over the first and last ten steps."""
    import json

    from tokenmill.config import RLConfig, load_config
    from tokenmill.controller import build_run, run_rl

    cfg = load_config(RLConfig, {
        "model": {"path": str(warm)},
        "data": {"task": "guess_number", "num_train": 100, "num_eval": num_eval},
        "env": {"name": "guess_number", "max_turns": 3, "max_episode_tokens": 64},  # held-out evaluation
        "generation": {"group_size": group_size, "max_tokens": 4},
        "training": {"learning_rate": learning_rate},
        "controller": {"steps": steps, "prompts_per_step": prompts_per_step, "eval_max_rows": num_eval},
        "tracking": {"output_dir": str(output_dir), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
        "proxy": {"port": 0, "wait_timeout_s": 120, "agent_command": agent_command},
    })
    run = build_run(cfg)
    try:
        result = run_rl(run)
    finally:
        run.close()
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    result["agent_success_first10"] = sum(rewards[:10]) / max(1, len(rewards[:10]))
    result["agent_success_last10"] = sum(rewards[-10:]) / max(1, len(rewards[-10:]))
    result["version_lag_max"] = max((r["proxy/version_lag_max"] for r in rows if "reward/mean" in r), default=0)
    result["trained_steps"] = len(rewards)
    return result
