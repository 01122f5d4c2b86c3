"""The model folder a run leaves behind: a plain HF folder any tool loads."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def export_model(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """A plain HF folder any tool loads; with LoRA the adapters are merged into it (a copy: the training
    module keeps its adapters) and the adapter alone is saved in `path/adapter` for peft."""
    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(path / "adapter")
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
