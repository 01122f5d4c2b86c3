"""A tokenmill config dict -> `MemoryPlan` -> the estimate's JSON answer (`estimate_for_config`).

The training schema has no fields for what only the estimate needs (numerics of other backends,
checkpointing, prompt lengths, budgets): they come as optional keys under `estimate:`, validated here
with the same one-line-per-field errors as the rest of the config. The trainers accept and drop that
section and `mode:` (`config.modes`), so one YAML serves `tokenmill train` and `tokenmill estimate`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tokenmill.config.modes import MODES, infer_mode
from tokenmill.estimate.memory import GIB, MemoryPlan, estimate, recommend_backend, solve_budget
from tokenmill.estimate.model_specs import LINEARS, ModelShape, resolve_shape
from tokenmill.estimate.report import to_dict
from tokenmill.types import ConfigError


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
    images_per_prompt: int = Field(
        0, ge=0, le=1024, description="Vision-language policy: pictures in each prompt (RL) or sequence (SFT / "
        "preference); their image tokens are added to prompt_tokens / seq_len.")
    image_size: tuple[int, int] = Field(
        (448, 448), description="Height and width in pixels of a typical picture; the model's image processor "
        "decides its image tokens.")

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int]) -> tuple[int, int]:
        if min(value) <= 0 or max(value) / min(value) > 200:
            raise ValueError("two positive sides in pixels (height, width), at most 200:1")
        return value


def _options(config: dict[str, Any]) -> EstimateOptions:
    raw = config.get("estimate") or {}
    if not isinstance(raw, dict):
        raise ConfigError("estimate: must be a mapping of estimate options")
    try:
        return EstimateOptions.model_validate(raw)
    except ValidationError as exc:
        from tokenmill.config import format_validation_error

        raise ConfigError("\n".join("estimate." + line for line in format_validation_error(exc, EstimateOptions).splitlines())) from None


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


def image_tokens(policy: ModelShape, opts: EstimateOptions) -> int:
    """Image tokens of one `estimate.image_size` picture for a vision-language policy (0 for a text model)."""
    return 0 if policy.image_grid is None else policy.image_grid.tokens(*opts.image_size)


def _rl_fields(cfg: Any, opts: EstimateOptions, policy: ModelShape) -> dict[str, Any]:
    algo, gen = cfg.algorithm, cfg.generation
    sequences = cfg.sequences_per_step
    critic = critic_rank = None
    if algo.advantage == "gae":
        critic = _shape(cfg.critic.path, "critic.path") if cfg.critic.path else policy
        critic_rank = getattr(getattr(cfg.critic, "lora", None), "rank", 0)
    rewards = tuple(_shape(r.path, f"rewards.{i}.path") for i, r in enumerate(cfg.rewards) if r.type == "model")
    if cfg.env is not None:  # an episode's whole budget sits in the KV cache; live episodes are capped
        prompt, completion, in_flight = 0, cfg.env.max_episode_tokens, min(sequences, cfg.env.max_concurrent)
    else:
        prompt = opts.prompt_tokens + opts.images_per_prompt * image_tokens(policy, opts)
        completion, in_flight = gen.max_tokens, sequences
    return {"algorithm": "ppo" if algo.advantage == "gae" else f"{algo.advantage}/{algo.loss}",
            "reference": algo.kl_coef > 0, "critic": critic, "critic_lora_rank": critic_rank or 0,
            "reward_models": rewards, "micro_batch_tokens": cfg.training.micro_batch_tokens,
            "prompt_tokens": prompt, "completion_tokens": completion, "sequences_in_flight": in_flight,
            "global_sequences": math.ceil(sequences / algo.mini_batches),
            # engine servers (placement process / remote, or Ray's engine replicas on devices of their own)
            # generate on other devices than the trainer's
            "engine": opts.engine if cfg.engine.placement in ("colocated", "thread", "worker")
            and not (cfg.cluster.backend == "ray" and cfg.cluster.engine_replicas and not cfg.cluster.colocate)
            else "none",
            "engine_copy": cfg.engine.placement in ("thread", "worker"),
            "engine_memory_utilization": opts.engine_memory_utilization, "engine_sleep": opts.engine_sleep}


def plan_from_config(
    config: dict[str, Any], *, device_memory_gib: float | None = None, num_devices: int = 1
) -> tuple[MemoryPlan, list[str]]:
    """Validate `config` against its mode's schema and translate it; returns the plan and notes."""
    from tokenmill.config import load_config

    if not isinstance(config, dict):
        raise ConfigError("config: expected a mapping of sections")
    mode, notes = infer_mode(config)
    opts = _options(config)
    cfg = load_config(MODES[mode].schema, {**config, "mode": mode})  # checks and drops mode / estimate
    policy = _shape(cfg.model.path, "model.path")
    devices = num_devices if num_devices != 1 else opts.num_devices
    if mode == "rl" and cfg.cluster.backend == "ray" and devices == 1:  # the trainer is sharded over its ranks
        devices = cfg.cluster.trainer_ranks
    memory_gib = device_memory_gib if device_memory_gib is not None else opts.device_memory_gib
    on_cpu = cfg.model.device == "cpu"
    training = getattr(cfg, "training", None)
    precision = opts.precision
    if precision == "auto":
        precision = "fp32" if on_cpu or cfg.model.dtype == "float32" else "amp"
    fields: dict[str, Any] = {
        "policy": policy, "mode": mode, "algorithm": mode, "precision": precision, "optimizer": opts.optimizer,
        # a run's own switches count too (training.activation_checkpointing, training.optimizer_offload)
        "gradient_checkpointing": opts.gradient_checkpointing or getattr(training, "activation_checkpointing", False),
        "optimizer_offload": bool(getattr(training, "optimizer_offload", False)), "logprobs": opts.logprobs,
        "lora_rank": cfg.model.lora.rank, "lora_targets": _lora_targets(cfg.model.lora.target_modules, policy, notes),
        "freeze_vision": getattr(cfg.model, "freeze_vision", True),
        "frozen_quant": opts.frozen_quant, "num_devices": devices,
        "sharding": ("fsdp" if devices > 1 else "none") if opts.sharding == "auto" else opts.sharding,
        "device": "cpu" if on_cpu else "cuda", "margin": opts.margin,
        "device_memory_bytes": None if memory_gib is None else int(memory_gib * GIB),
    }
    seq_len = opts.seq_len + opts.images_per_prompt * image_tokens(policy, opts)
    if mode == "rl":
        fields |= _rl_fields(cfg, opts, policy)
    elif mode == "sft":
        fields |= {"micro_batch_tokens": cfg.micro_batch_tokens, "completion_tokens": seq_len,
                   "global_sequences": cfg.batch_size}
    else:  # tokenmill's pairwise training runs a step's chosen and rejected sequences in one forward
        fields |= {"algorithm": cfg.objective, "reference": cfg.objective in ("dpo", "ipo"),
                   "micro_batch_tokens": 2 * cfg.batch_size * seq_len, "completion_tokens": seq_len,
                   "global_sequences": 2 * cfg.batch_size}
    return MemoryPlan(**fields), notes



def estimate_for_config(
    config: dict[str, Any], *, device_memory_gib: float | None = None, num_devices: int = 1
) -> dict[str, Any]:
    """The estimate of a tokenmill config given as a plain dict (what `tokenmill train / sft / preference`
    accept, optional `mode` and `estimate:` keys included; see `EstimateOptions`). The arguments override
    `estimate.device_memory_gib` / `estimate.num_devices` (num_devices when not 1). Raises `ConfigError`
    naming the field on bad input."""
    plan, notes = plan_from_config(config, device_memory_gib=device_memory_gib, num_devices=num_devices)
    est = estimate(plan)
    est.warnings[:0] = notes
    result = to_dict(est, solve_budget(plan), recommend_backend(plan))
    if plan.policy.image_grid is not None:
        opts = _options(config)
        result["vision"] = {"params": plan.policy.vision_params, "image_size": list(opts.image_size),
                            "image_tokens": image_tokens(plan.policy, opts), "images_per_prompt": opts.images_per_prompt}
    cluster = config.get("cluster") if plan.mode == "rl" else None
    if isinstance(cluster, dict) and cluster.get("backend") == "ray":  # validated above with the whole config
        from tokenmill.config.cluster import placement_of_config

        try:
            result["placement"] = placement_of_config(config)
        except ConfigError as exc:  # the memory still holds; `tokenmill plan` and validate refuse the layout
            result["warnings"].append(f"placement: {exc}")
    return result
