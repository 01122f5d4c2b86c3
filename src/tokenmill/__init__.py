"""tokenmill: reinforcement-learning post-training for language models.

The runs (`train`, `sft`, `preference`, `reward_model`) and the config classes are imported on first use, so
that `import tokenmill` (and `tokenmill validate`) stays fast: nothing of the ML stack (torch, transformers,
datasets) loads until a run needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.api import preference, reward_model, sft, train
    from tokenmill.config.offline import PreferenceConfig, SFTConfig
    from tokenmill.config.schema import RLConfig
    from tokenmill.types import Completion, Group, Sample, SamplingParams, StopReason

__version__ = "0.1.0"
__all__ = [
    "Completion", "Group", "PreferenceConfig", "RLConfig", "SFTConfig", "Sample", "SamplingParams", "StopReason",
    "preference", "reward_model", "sft", "train",
]

_HOMES = {
    "train": "tokenmill.api",
    "sft": "tokenmill.api",
    "preference": "tokenmill.api",
    "reward_model": "tokenmill.api",
    "RLConfig": "tokenmill.config.schema",
    "SFTConfig": "tokenmill.config.offline",
    "PreferenceConfig": "tokenmill.config.offline",
    "Completion": "tokenmill.types",
    "Group": "tokenmill.types",
    "Sample": "tokenmill.types",
    "SamplingParams": "tokenmill.types",
    "StopReason": "tokenmill.types",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
