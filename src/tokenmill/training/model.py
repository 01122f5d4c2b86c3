"""Loading the policy a run trains: the device, the autocast dtype, the HF model and tokenizer (with LoRA
adapters when asked), and its parameter counts."""

from __future__ import annotations

import os
from typing import Any

import torch

from tokenmill.config.schema import ModelConfig
from tokenmill.training.allocator import keep_freed_memory
from tokenmill.types import ConfigError


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {spec!r} requested but CUDA is not available")
    return device


def autocast_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (fp32 master weights) on GPU by default; plain fp32 on CPU."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


MEMORY_ENV = "TOKENMILL_DEVICE_MEMORY_GIB"  # the memory `check_memory` checks against, on any device


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory of `device` for the fit check: $TOKENMILL_DEVICE_MEMORY_GIB where set, a CUDA device's total,
    else None (a CPU run is not checked)."""
    override = os.environ.get(MEMORY_ENV, "").strip()
    if override:
        try:
            gib = float(override)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ConfigError(f"{MEMORY_ENV}: expected the device memory in GiB (a positive number), got {override!r}")
        return int(gib * 2**30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_memory(cfg: Any, device: torch.device) -> None:
    """Refuse (ConfigError) a run whose `tokenmill estimate` peak exceeds the device's memory, before any weight
    loads, naming the settings that would fit (`estimate.fit`). `training.memory_check: false` skips it; a
    model the estimate cannot read (no config.json it knows) and a sharded trainer (fsdp2, Ray) are not
    checked."""
    from tokenmill.estimate.fit import fit_refusal, run_config

    if not cfg.training.memory_check or cfg.training.backend != "local" or cfg.cluster.backend == "ray":
        return  # sharded trainers: the estimate's per-device split is not what this rank holds
    memory = device_memory_bytes(device)
    if memory is None:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and not os.environ.get(MEMORY_ENV) else (
        f"{device.type} ({MEMORY_ENV})")
    try:
        refusal = fit_refusal(run_config(cfg, device.type), memory, name)
    except (ConfigError, ValueError):
        return
    if refusal is not None:
        raise ConfigError(refusal)


def load_policy(cfg: ModelConfig, device: torch.device):
    """(model, tokenizer) from `model.path` on `device`, wrapped with peft LoRA adapters when `model.lora.rank`
    is set (only they train; the engine samples from the same module). ConfigError names the field.

    A vision-language model (its config has a `vision_config`) loads as `AutoModelForImageTextToText`, its
    vision tower frozen unless `model.freeze_vision` is false; its LoRA adapters ('all-linear') go on the
    language model's layers only (`training.vision`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from tokenmill.engines.local.vision import is_vision_config
    from tokenmill.training.lora import add_lora
    from tokenmill.training.vision import LANGUAGE_LORA_TARGETS, freeze_vision_tower

    if device.type == "cpu":  # a CPU trainer's steps reuse freed memory instead of faulting pages in again
        keep_freed_memory()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.path)
        vision = is_vision_config(AutoConfig.from_pretrained(cfg.path))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(cfg.path, **kwargs).to(device)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot load {cfg.path!r}: {exc}") from None
    lora = cfg.lora
    if vision:
        freeze_vision_tower(model, cfg.freeze_vision)
        if lora.target_modules == "all-linear":  # the language model's projections, not the vision tower's
            lora = lora.model_copy(update={"target_modules": LANGUAGE_LORA_TARGETS})
    if lora.rank > 0:
        model = add_lora(model, lora, task_type="CAUSAL_LM", field="model.lora")
        if vision and not cfg.freeze_vision:  # the tower trains in full beside the adapters
            freeze_vision_tower(model, False)
    return model, tokenizer


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
