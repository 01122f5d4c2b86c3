"""tokenmill: reinforcement-learning post-training for language models.

`train` and the config classes are imported on first use, so that `import tokenmill` (and `tokenmill
validate`) stays fast: nothing of the ML stack (torch, transformers, datasets) loads until a run needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.api import train
    from tokenmill.config.schema import RLConfig, SFTConfig
    from tokenmill.types import Completion, Group, Sample, SamplingParams, StopReason

__version__ = "0.1.0"
__all__ = ["Completion", "Group", "RLConfig", "SFTConfig", "Sample", "SamplingParams", "StopReason", "train"]

_HOMES = {
    "train": "tokenmill.api",
    "RLConfig": "tokenmill.config.schema",
    "SFTConfig": "tokenmill.config.schema",
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
