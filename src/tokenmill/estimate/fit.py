"""Refuse a run that will not fit its device before any weight loads (`training.memory_check`).

`fit_refusal(config, memory_bytes)` runs `tokenmill estimate` on the run's own config against the device's
memory and, when the peak is over it, says by how much and which settings would make it fit: a smaller
micro-batch where one sequence fits, else the estimate's proposals in their config keys. No torch here: the
caller (`training.model.check_memory`) reads the device's memory.
"""

from __future__ import annotations

from typing import Any

from tokenmill.estimate.memory import GIB, estimate, solve_budget

# the estimate's own keys for what a run sets in its training section
RUN_SETTINGS = {
    "estimate.gradient_checkpointing: true": "training.activation_checkpointing: true",
    "estimate.logprobs: chunked": "training.chunked_logprobs: true",
}


def _run_setting(setting: str) -> str:
    if setting.startswith("num_devices: "):  # "num_devices: N, estimate.sharding: fsdp"
        n = setting.split(",")[0].split(": ")[1]
        return f"training.backend: fsdp2 over {n} GPUs (torchrun --nproc-per-node {n})"
    return RUN_SETTINGS.get(setting, setting)


def run_config(cfg: Any, device_type: str) -> dict[str, Any]:
    """A validated run config as the estimate reads it: on the device it resolved to, with the `estimate:`
    options its training section implies (its log-prob path)."""
    tree = cfg.model_dump(mode="json")
    tree["model"]["device"] = device_type
    tree["estimate"] = {"logprobs": "chunked" if cfg.training.chunked_logprobs else "gather"}
    return tree


def fit_refusal(config: dict[str, Any], memory_bytes: int, device_name: str = "the device") -> str | None:
    """None when the estimate of `config` (an RL config as a dict) fits `memory_bytes`, else the refusal:
    the estimate, the budget, and the settings that would fit."""
    from tokenmill.estimate.config import plan_from_config

    plan, _ = plan_from_config(config, device_memory_gib=memory_bytes / GIB)
    dev = estimate(plan).device
    if dev.fits:
        return None
    lines = [(f"training.memory_check: tokenmill estimate puts this run's peak at {dev.total / GIB:.2f} GiB "
             f"({dev.peak_phase} phase) and {device_name} has {memory_bytes / GIB:.1f} GiB; nothing was loaded.")]
    budget = solve_budget(plan)
    if budget is not None and budget.micro_batch >= 1 and budget.rollout_fits:
        lines.append(f"It fits with training.micro_batch_tokens: {budget.micro_batch * plan.seq_len} "
                     f"(gradients accumulate over more micro-batches; same update).")
    elif budget is not None and budget.proposals:
        fixes = [f"{_run_setting(p.setting)} ({p.action}, saves {p.saving_bytes / GIB:.2f} GiB"
                 + (": then it fits)" if p.fits_after else ")") for p in budget.proposals]
        lines.append("Settings that bring it down, in order: " + "; ".join(fixes) + ".")
    lines.append("training.memory_check: false loads it anyway.")
    return " ".join(lines)
