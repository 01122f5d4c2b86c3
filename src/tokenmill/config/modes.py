"""The four run modes, which command trains each, and which mode a config tree is.

One table serves `tokenmill train|sft|preference`, `tokenmill estimate` and the Composer, so a YAML written
for one of them reads the same in the others. A config may name its mode (`mode: sft`) and carry an
`estimate:` section for the memory estimate; the trainers accept both and drop them (`strip_extras`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tokenmill.config.offline import PreferenceConfig, SFTConfig
from tokenmill.config.schema import RLConfig
from tokenmill.types import ConfigError


@dataclass(frozen=True)
class Mode:
    """A run mode: its schema, the CLI command that trains it and the top-level values it fixes."""

    id: str
    title: str
    command: str
    schema: type[BaseModel]
    fixed: dict[str, Any] = field(default_factory=dict)


MODES: dict[str, Mode] = {m.id: m for m in (
    Mode("rl", "Online RL (GRPO / PPO)", "train", RLConfig),
    Mode("preference", "Offline preference (DPO / IPO / SimPO)", "preference", PreferenceConfig),
    # reward modelling is PreferenceConfig with its objective fixed
    Mode("reward_model", "Reward modelling (Bradley-Terry)", "preference", PreferenceConfig,
         {"objective": "reward_model"}),
    Mode("sft", "Supervised fine-tuning (SFT)", "sft", SFTConfig),
)}
# Top-level keys only one schema has (derived, so a new field keeps the inference right): a tree holding any
# of them is that mode. SFT and preference share the trainer keys (steps, batch_size, ...).
_RL, _SFT, _PREF = (set(schema.model_fields) for schema in (RLConfig, SFTConfig, PreferenceConfig))
RL_KEYS = frozenset(_RL - _SFT - _PREF)
SFT_KEYS = frozenset(_SFT - _PREF - _RL)
PREFERENCE_KEYS = frozenset(_PREF - _SFT - _RL)
OFFLINE_KEYS = frozenset((_SFT & _PREF) - _RL)
EXTRA_KEYS = ("mode", "estimate")  # read by the estimate and the Composer, never by a trainer


def mode(name: str) -> Mode:
    """The mode called `name`; `ConfigError` naming the field otherwise."""
    if name not in MODES:
        raise ConfigError(f"mode: must be one of {', '.join(MODES)} (got {name!r})")
    return MODES[name]


def infer_mode(tree: dict[str, Any]) -> tuple[str, list[str]]:
    """The tree's `mode:` if given, else read from the sections present, with a note when it is a guess.

    Each mode is recognised by a key only its schema has (`objective` / `beta` for preference). A tree of only
    `model` and `data` (and unknown keys, which its schema then rejects) reads as RL; the trainer keys SFT and
    preference share (`steps`, `batch_size`, ...) read as SFT, with a note saying how to choose.
    """
    if "mode" in tree:
        return mode(tree["mode"]).id, []
    keys = set(tree)
    if keys & PREFERENCE_KEYS:
        return ("reward_model" if tree.get("objective") == "reward_model" else "preference"), []
    if keys & RL_KEYS:
        return "rl", []
    if keys & SFT_KEYS:
        return "sft", []
    if keys & OFFLINE_KEYS:
        return "sft", ["mode inferred as sft; set mode: preference for a DPO config without objective/beta"]
    return "rl", []


def strip_extras(tree: dict[str, Any], schema: type[BaseModel]) -> dict[str, Any]:
    """`tree` without `mode:` / `estimate:`, for `schema`'s trainer. A `mode:` naming another trainer's
    config is refused with the command to use; its fixed values (reward_model's objective) are applied."""
    if "mode" not in tree:
        return {k: v for k, v in tree.items() if k != "estimate"}
    m = mode(tree["mode"])
    if m.schema is not schema:
        raise ConfigError(f"mode: a {m.id} config is trained with `tokenmill {m.command}`, not this command")
    out = {k: v for k, v in tree.items() if k not in EXTRA_KEYS}
    for key, value in m.fixed.items():
        if out.setdefault(key, value) != value:
            raise ConfigError(f"{key}: mode {m.id} fixes it to {value!r} (got {out[key]!r})")
    if m.id == "preference" and out.get("objective") == "reward_model":
        raise ConfigError("objective: reward_model is its own mode: set mode: reward_model")
    return out
