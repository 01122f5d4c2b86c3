"""The parent's summary of both children's results: per-trainer statistics, the config side by side, the
ratio table and the warnings about machine load."""

from __future__ import annotations

from typing import Any

from vs_trl_parts.measure import step_stats, train_reward_summary


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
        "peak_rss_mib": peak_rss(r),
        "eval_acc_before": r["eval_before"]["eval/accuracy"],
        "eval_acc_after": r["eval_after"]["eval/accuracy"],
        "eval_rows": r["eval_after"]["eval/rows"],
        "train_reward": train_reward_summary(r["train_reward"]),
    }


def peak_rss(r: dict[str, Any]) -> float:
    """The trainer process's peak RSS; with tokenmill's worker placement, plus its engine worker's (the largest
    reaped child), since that process holds a second copy of the model."""
    peak = r["peak_rss_mib"]
    worker = r.get("config", {}).get("engine", {}).get("placement") == "worker"
    return peak["self"] + (peak["children"] if worker else 0.0)


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
    if spec.get("interleave"):
        print(f"interleaved by blocks of {spec['interleave']} steps: tokenmill had {tm.get('turns')} turns, TRL "
              f"{tr.get('turns')}; the load of 'other processes' above is mostly the other trainer's turns, while "
              "this one waited untimed")
    elif busy > 0.25:
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

