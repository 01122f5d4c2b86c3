"""A tokenmill config dict -> `MemoryPlan`; the estimate -> its JSON answer and `tokenmill estimate`'s table.

The training schema has no fields for what only the estimate needs (numerics of other backends,
checkpointing, prompt lengths, budgets): they come as optional keys under `estimate:`, validated here
with the same one-line-per-field errors as the rest of the config.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.composer.memory import (
    GB,
    GIB,
    BudgetSolution,
    MemoryEstimate,
    MemoryPlan,
    ModelMemory,
    by_phase,
)
from tokenmill.composer.model_specs import LINEARS, ModelShape, resolve_shape
from tokenmill.types import ConfigError

MODES = ("rl", "preference", "reward_model", "sft")
RL_KEYS = {"generation", "algorithm", "rewards", "controller", "env", "critic", "training", "tracking", "checkpoint"}
SFT_KEYS = {"completion_column", "messages_column", "packing", "micro_batch_tokens"}


class EstimateOptions(BaseModel):
    """The `estimate:` section of a config: only the memory estimate reads it (training ignores it)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    precision: Literal["auto", "fp32", "amp", "bf16_mixed", "bf16"] = Field(
        "auto", description="auto: what tokenmill does with model.dtype (fp32 weights + bf16 autocast = amp on "
        "GPU, fp32 on CPU); bf16_mixed: bf16 weights + fp32 master; bf16: pure bf16 (8 bytes/param with AdamW).")
    optimizer: Literal["adamw", "adamw_8bit"] = Field("adamw", description="AdamW moments at full or 8-bit precision.")
    gradient_checkpointing: bool = Field(False, description="Keep only each layer's input; recompute in backward.")
    logprobs: Literal["naive", "gather", "chunked"] = Field(
        "gather", description="Token log-prob computation: naive log-softmax (10 B/logit in bf16), gathered logit "
        "minus logsumexp (tokenmill's, 6 B), chunked (2 B).")
    frozen_quant: Literal["none", "int8", "nf4"] = Field("none", description="Storage of a LoRA model's frozen base.")
    sharding: Literal["auto", "none", "zero1", "zero2", "fsdp"] = Field(
        "auto", description="Model-state sharding over the devices; auto: fsdp (ZeRO-3) on several, none on one.")
    num_devices: int = Field(1, ge=1, le=4096, description="Data-parallel devices.")
    device_memory_gib: float | None = Field(None, gt=0, description="Memory of one device; enables the budget solver.")
    prompt_tokens: int = Field(256, ge=0, description="RL: typical prompt length in tokens.")
    seq_len: int = Field(512, ge=1, description="SFT / preference: tokens per sequence (prompt + completion).")
    engine: Literal["hf", "vllm"] = Field("hf", description="RL rollout engine: tokenmill's in-process HF or vLLM.")
    engine_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM's gpu_memory_utilization: the share of the device it reserves.")
    engine_sleep: bool = Field(False, description="vLLM sleeps (weights offloaded, KV freed) while training.")
    margin: float = Field(0.1, ge=0, lt=0.5, description="Share of the device kept free for fragmentation.")


def infer_mode(config: dict[str, Any]) -> tuple[str, list[str]]:
    """`mode` if given; else from the sections present. A config of only model and data reads as RL."""
    if "mode" in config:
        if config["mode"] not in MODES:
            raise ConfigError(f"mode: must be one of {', '.join(MODES)} (got {config['mode']!r})")
        return config["mode"], []
    keys = set(config)
    if "objective" in keys or "beta" in keys:
        return ("reward_model" if config.get("objective") == "reward_model" else "preference"), []
    if keys & RL_KEYS:
        return "rl", []
    if keys & SFT_KEYS or keys - {"model", "data"}:
        return "sft", ["mode inferred as sft; set mode: preference for a DPO config without objective/beta"]
    return "rl", []


def _options(config: dict[str, Any]) -> EstimateOptions:
    raw = config.get("estimate") or {}
    if not isinstance(raw, dict):
        raise ConfigError("estimate: must be a mapping of estimate options")
    try:
        return EstimateOptions.model_validate(raw)
    except ValidationError as exc:
        from tokenmill.config import format_validation_error

        raise ConfigError("\n".join("estimate." + line for line in format_validation_error(exc).splitlines())) from None


def _shape(source: str, field: str) -> ModelShape:
    try:
        return resolve_shape(source)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def _lora_targets(targets: Any, shape: ModelShape, notes: list[str]) -> tuple[str, ...]:
    if targets == "all-linear":
        return LINEARS
    unknown = [t for t in targets if t not in shape.linear_dims()]
    if unknown:
        notes.append(f"model.lora.target_modules: {unknown} are not linear layers the estimate knows "
                     f"({', '.join(LINEARS)}); counted as not adapted")
    return tuple(t for t in targets if t in shape.linear_dims())


def _rl_fields(cfg: Any, opts: EstimateOptions, policy: ModelShape) -> dict[str, Any]:
    algo, gen, ctl = cfg.algorithm, cfg.generation, cfg.controller
    sequences = ctl.prompts_per_step * gen.group_size
    critic = critic_rank = None
    if algo.advantage == "gae":
        critic = _shape(cfg.critic.path, "critic.path") if cfg.critic.path else policy
        critic_rank = getattr(getattr(cfg.critic, "lora", None), "rank", 0)
    rewards = tuple(_shape(r.path, f"rewards.{i}.path") for i, r in enumerate(cfg.rewards) if r.type == "model")
    if cfg.env is not None:  # an episode's whole budget sits in the KV cache; live episodes are capped
        prompt, completion, in_flight = 0, cfg.env.max_episode_tokens, min(sequences, cfg.env.max_concurrent)
    else:
        prompt, completion, in_flight = opts.prompt_tokens, gen.max_tokens, sequences
    return {"algorithm": "ppo" if algo.advantage == "gae" else f"{algo.advantage}/{algo.loss}",
            "reference": algo.kl_coef > 0, "critic": critic, "critic_lora_rank": critic_rank or 0,
            "reward_models": rewards, "micro_batch_tokens": cfg.training.micro_batch_tokens,
            "prompt_tokens": prompt, "completion_tokens": completion, "sequences_in_flight": in_flight,
            "global_sequences": math.ceil(sequences / algo.mini_batches), "engine": opts.engine,
            "engine_memory_utilization": opts.engine_memory_utilization, "engine_sleep": opts.engine_sleep}


def plan_from_config(
    config: dict[str, Any], *, device_memory_gib: float | None = None, num_devices: int = 1
) -> tuple[MemoryPlan, list[str]]:
    """Validate `config` against its mode's schema and translate it; returns the plan and notes."""
    from tokenmill.config import PreferenceConfig, RLConfig, SFTConfig, load_config

    if not isinstance(config, dict):
        raise ConfigError("config: expected a mapping of sections")
    mode, notes = infer_mode(config)
    opts = _options(config)
    tree = {k: v for k, v in config.items() if k not in ("mode", "estimate")}
    if mode == "reward_model":
        tree.setdefault("objective", "reward_model")
    schema = {"rl": RLConfig, "sft": SFTConfig, "preference": PreferenceConfig, "reward_model": PreferenceConfig}
    cfg = load_config(schema[mode], tree)
    policy = _shape(cfg.model.path, "model.path")
    devices = num_devices if num_devices != 1 else opts.num_devices
    memory_gib = device_memory_gib if device_memory_gib is not None else opts.device_memory_gib
    on_cpu = cfg.model.device == "cpu"
    precision = opts.precision
    if precision == "auto":
        precision = "fp32" if on_cpu or cfg.model.dtype == "float32" else "amp"
    fields: dict[str, Any] = {
        "policy": policy, "mode": mode, "algorithm": mode, "precision": precision, "optimizer": opts.optimizer,
        "gradient_checkpointing": opts.gradient_checkpointing, "logprobs": opts.logprobs,
        "lora_rank": cfg.model.lora.rank, "lora_targets": _lora_targets(cfg.model.lora.target_modules, policy, notes),
        "frozen_quant": opts.frozen_quant, "num_devices": devices,
        "sharding": ("fsdp" if devices > 1 else "none") if opts.sharding == "auto" else opts.sharding,
        "device": "cpu" if on_cpu else "cuda", "margin": opts.margin,
        "device_memory_bytes": None if memory_gib is None else int(memory_gib * GIB),
    }
    if mode == "rl":
        fields |= _rl_fields(cfg, opts, policy)
    elif mode == "sft":
        fields |= {"micro_batch_tokens": cfg.micro_batch_tokens, "completion_tokens": opts.seq_len,
                   "global_sequences": cfg.batch_size}
    else:  # tokenmill's pairwise training runs a step's chosen and rejected sequences in one forward
        fields |= {"algorithm": cfg.objective, "reference": cfg.objective in ("dpo", "ipo"),
                   "micro_batch_tokens": 2 * cfg.batch_size * opts.seq_len, "completion_tokens": opts.seq_len,
                   "global_sequences": 2 * cfg.batch_size}
    return MemoryPlan(**fields), notes


def model_peak(m: ModelMemory) -> int:
    """The model's persistent bytes plus its largest phase (its items of different phases never coexist)."""
    parts = by_phase(m)
    return parts.pop("persistent", 0) + max(parts.values(), default=0)


def to_dict(est: MemoryEstimate, budget: BudgetSolution | None, advice: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer of `estimate_for_config` (bytes as integers; GB = 10^9 bytes in the `*_gb` copies)."""
    plan, dev = est.plan, est.device
    settings = {k: v for k, v in asdict(plan).items() if k not in ("policy", "critic", "reward_models")}
    settings |= {"lora_targets": list(plan.lora_targets), "seq_len": plan.seq_len,
                 "micro_batch_tokens_effective": plan.tokens}
    models = [{"role": m.role, "device": m.device, "trainable": m.trainable, "params": m.params,
               "trainable_params": m.trainable_params, "bytes": m.bytes, "phases": m.phases,
               "peak_bytes": model_peak(m)} for m in est.models]
    device = {"name": dev.name, "count": plan.num_devices, "persistent_bytes": dev.persistent,
              "phase_bytes": dev.phases, "peak_phase": dev.peak_phase, "overhead_bytes": dev.overhead,
              "margin_bytes": dev.margin, "total_bytes": dev.total, "total_gb": round(dev.total / GB, 2),
              "budget_bytes": dev.budget, "fits": dev.fits}
    out: dict[str, Any] = {"mode": plan.mode, "algorithm": plan.algorithm, "model": plan.policy.to_dict(),
                           "settings": settings, "models": models, "devices": [device],
                           "warnings": list(est.warnings), "recommendation": advice, "budget": None}
    if budget is not None:
        out["budget"] = {**{k: v for k, v in asdict(budget).items() if k != "proposals"}, "fits": budget.fits,
                         "suggested_micro_batch_tokens": budget.micro_batch * plan.seq_len,
                         "proposals": [asdict(p) for p in budget.proposals]}
    return out


def _gb(value: int | None) -> str:
    return "" if not value else f"{value / GB:.2f}"


def render(result: dict[str, Any]) -> None:
    """Print `estimate_for_config`'s answer as tables on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    console, model, st, dev = Console(), result["model"], result["settings"], result["devices"][0]
    console.print(f"[bold]{model['name']}[/]: {model['params']:,} parameters; {result['mode']} ({result['algorithm']}),"
                  f" {st['precision']}, {st['micro_batch_tokens_effective']} tokens per micro-batch, "
                  f"{st['num_devices']} device(s), sharding {st['sharding']}")
    parts = list(dict.fromkeys(k for m in result["models"] for k in m["bytes"]))
    table = Table(title="Memory on each device, GB (10^9 bytes)")
    table.add_column("component")
    table.add_column("phase")
    for m in result["models"]:
        table.add_column(m["role"] + ("" if m["trainable"] else " (frozen)"), justify="right")
    for key in parts:
        phase = next(m["phases"][key] for m in result["models"] if key in m["phases"])
        table.add_row(key, phase, *(_gb(m["bytes"].get(key)) for m in result["models"]))
    table.add_row("trainable params", "", *(f"{m['trainable_params']:,}" for m in result["models"]))
    table.add_row("peak", "", *(_gb(m["peak_bytes"]) for m in result["models"]))
    console.print(table)
    phases = ", ".join(f"{k} {_gb(v) or '0'}" for k, v in dev["phase_bytes"].items())
    budget = "" if dev["budget_bytes"] is None else (
        f" of {dev['budget_bytes'] / GIB:.1f} GiB: " + ("fits" if dev["fits"] else "[red]does not fit[/]"))
    console.print(f"device '{dev['name']}': persistent {_gb(dev['persistent_bytes'])} + peak phase "
                  f"{dev['peak_phase']} (phases: {phases}) + overhead {_gb(dev['overhead_bytes'])} + margin "
                  f"{_gb(dev['margin_bytes'])} = [bold]{dev['total_gb']:.2f} GB[/]{budget}")
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    rec = result["recommendation"]
    console.print(f"recommendation: {rec['backend']} - {rec['reason']}")
    b = result["budget"]
    if b is not None and b["fits"]:
        console.print(f"budget: up to {b['max_tokens']:,} tokens per micro-batch -> {b['micro_batch']} sequence(s) "
                      f"of {st['seq_len']}, gradient accumulation {b['grad_accum']} "
                      f"(micro_batch_tokens: {b['suggested_micro_batch_tokens']})")
    elif b is not None:
        console.print("budget: one sequence does not fit; in order:")
        for p in b["proposals"]:
            console.print(f"  - {p['action']} ({p['setting']}): saves {_gb(p['saving_bytes']) or '0'} GB"
                          + (" -> fits" if p["fits_after"] else ""))
