"""The base of every config section: unknown keys refused, numbers strict, and sanity bounds."""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Sanity bounds: far above any real run, low enough that a typo (10**12 tokens) is an error, not an OOM hours in.
MAX_INT = 2**31 - 1  # every whole-number field (a 32-bit index or count)
MAX_TOKENS = 1 << 20  # new tokens of one completion; also the largest top_k
MAX_GROUP = 4096  # completions per prompt
MAX_SEQUENCES = 1 << 22  # sequences per step (prompts x group size)
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: object, info: ValidationInfo) -> object:
        """YAML's `true` is not 1 (pydantic would take it as one)."""
        kinds = _number_kinds(cls).get(info.field_name or "")
        if kinds and isinstance(value, bool):
            raise ValueError(f"expected a {'whole ' if float not in kinds else ''}number, not a boolean")
        return value

    @field_validator("*")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """Runs after each field's own bounds: a whole number no field's own bound caps stays within MAX_INT."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"must be at most {MAX_INT:,} in size")
        return value


_NUMBER_KINDS: dict[type, dict[str, set[type]]] = {}


def _number_kinds(cls: type[BaseModel]) -> dict[str, set[type]]:
    """Field name -> the number types it takes (int / float, optional or not), per class."""
    if cls not in _NUMBER_KINDS:
        kinds = {name: {t for t in (info.annotation, *get_args(info.annotation)) if t in (int, float)}
                 for name, info in cls.model_fields.items()}
        _NUMBER_KINDS[cls] = {name: k for name, k in kinds.items() if k}
    return _NUMBER_KINDS[cls]

class LoRAConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (full fine-tuning).")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator (the update is scaled by alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' (every linear layer but the output head)."
    )
