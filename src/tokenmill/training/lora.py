"""LoRA adapters (peft) for every model tokenmill trains: the policy, a reward model, the PPO critic.

A policy adapts its linear layers only. A reward model or critic also has a freshly initialised scalar head
(`score`) that must train in full, so for those the head is kept out of the adapted layers and trained as a
peft "module to save"; `merge_and_unload` then puts the trained head back in place, and the merged model saves
as a plain `AutoModelFor...Classification` folder.
"""

from __future__ import annotations

from typing import Literal

import torch

from tokenmill.config.schema import LoRAConfig
from tokenmill.types import ConfigError

TaskType = Literal["CAUSAL_LM", "SEQ_CLS", "TOKEN_CLS"]
HEAD_NAMES = ("score", "classifier")  # the scalar heads of HF sequence / token classifiers


def add_lora(model: torch.nn.Module, cfg: LoRAConfig, *, task_type: TaskType, field: str) -> torch.nn.Module:
    """Wrap `model` with rank-`cfg.rank` adapters; only they (and a classifier's head) train. Errors name
    `field` (the config path of `cfg`, e.g. "critic.lora")."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError(f"{field}.rank: LoRA needs peft (pip install 'tokenmill[lora]')") from None
    heads = [name for name in HEAD_NAMES if task_type != "CAUSAL_LM" and hasattr(model, name)]
    lora = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules,
        task_type=task_type,
        # "all-linear" would adapt a token classifier's head too, and a head cannot be both adapted and saved
        exclude_modules=heads or None, modules_to_save=heads or None,
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        raise ConfigError(f"{field}.target_modules: {exc}") from None


def is_lora(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (one whose adapters can be switched off to get the base back)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
