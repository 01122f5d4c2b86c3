"""Each trainer's run, in its own child process (so peak RSS is its own): tokenmill through
`tokenmill.train`, TRL through `GRPOTrainer`, on the same spec, timed over the training steps only."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from vs_trl_parts.baton import Baton
from vs_trl_parts.measure import current_rss_mib, evaluate_model, load_meter


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
            "max_staleness": spec.get("max_staleness", 0),
        },
        "engine": {"fast_decode": spec.get("fast_decode", True), "placement": spec.get("placement", "colocated")},
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
    turn = Baton.of_child(spec.get("interleave", 0))
    if turn is not None:  # an interleaved run: each step waits for tokenmill's turn before its timer starts
        import contextlib

        import tokenmill.controller.rl as loop

        timed = loop.step_timer

        @contextlib.contextmanager
        def step_timer_after_turn(*args, **kwargs):
            turn.before_step()
            with timed(*args, **kwargs) as timer:
                yield timer

        loop.step_timer = step_timer_after_turn
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
        # at its best on CPU (benchmarks/README.md, "How comparisons are run"); bf16 autocast on a GPU
        bf16=spec.get("bf16", False),
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=spec.get("device", "cpu") == "cpu",
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


def step_timer(spec: dict[str, Any], seen: dict[str, Any], tokenizer, eval_rows):
    """A TrainerCallback timing each step (on_step_begin -> on_step_end) and counting the tokens generated in it
    (`seen["generated"]`, which the reward function adds to); every `eval_every` steps it evaluates outside
    the timed region."""
    import torch
    from transformers import TrainerCallback

    turn = Baton.of_child(spec.get("interleave", 0))

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
            if turn is not None:  # an interleaved run: wait for this trainer's turn, untimed
                turn.before_step()
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


    return StepTimer()


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
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

    timer = step_timer(spec, seen, tokenizer, eval_rows)
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

    measured = {"eval_before": eval_before, "eval_after": eval_after, "wall_seconds_train_call": wall,
                "cpu_load_train_call": load, "rss_before_train_mib": rss_before}
    return trl_result(spec, trainer, args, timer, seen) | {"version": trl.__version__, **measured}


def trl_result(spec: dict[str, Any], trainer, args, timer, seen: dict[str, Any]) -> dict[str, Any]:
    """What the TRL child reports besides its evaluations and wall times: steps, tokens, optimiser, samples."""
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
        "eval_curve": timer.curve,
        "torch_threads": sorted(timer.threads_seen),
        "wall_seconds_train_loop": timer.train_end - timer.train_begin,
        "sample_completions": seen["samples"],
    }

