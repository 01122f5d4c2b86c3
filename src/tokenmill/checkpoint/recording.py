"""What a recording (a rollout dump) means: the run settings its rollouts depend on, compared before a replay.

`run_fingerprint(cfg)` is plain JSON data: the policy model (its path and its config's shapes), what one step
samples (`generation.group_size`, `generation.max_tokens`, `controller.prompts_per_step`) and the data it
draws prompts from (`data.*`). A recording stores it (`rollout.record.MANIFEST`); a replay whose own
fingerprint differs is refused, naming each field (`fingerprint_changes`). The algorithm's settings (loss, clip
range, learning rate, mini-batches, seed) are not in it: changing them between record and replay is what a
replay is for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# the model config's fields that fix what its token ids and logprobs mean
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
DATA_KEYS = ("task", "path", "split", "prompt_column", "num_train", "task_kwargs")


def model_shapes(path: str) -> dict[str, Any]:
    """The shape fields of a local model folder's config.json ({} for a hub id or a folder without one)."""
    config = Path(path) / "config.json"
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    text = found.get("text_config") if isinstance(found.get("text_config"), dict) else found  # a multimodal wrapper
    return {k: text[k] for k in SHAPE_KEYS if k in text}


def run_fingerprint(cfg: Any) -> dict[str, Any]:
    """The settings a recording of this run depends on, by their config names (JSON-ready)."""
    out: dict[str, Any] = {"model.path": cfg.model.path}
    out |= {f"model.config.{k}": v for k, v in model_shapes(cfg.model.path).items()}
    out |= {"generation.group_size": cfg.generation.group_size, "generation.max_tokens": cfg.generation.max_tokens,
            "controller.prompts_per_step": cfg.controller.prompts_per_step}
    out |= {f"data.{k}": getattr(cfg.data, k) for k in DATA_KEYS if hasattr(cfg.data, k)}
    return json.loads(json.dumps(out, default=str))  # as a manifest reads back: tuples as lists, paths as text


def fingerprint_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each field whose value differs, as `name: recorded X, now Y` (empty when the two agree)."""

    def show(d: dict[str, Any], k: str) -> str:
        return repr(d[k]) if k in d else "(absent)"

    return [f"{k}: recorded {show(recorded, k)}, now {show(current, k)}"
            for k in sorted(recorded.keys() | current.keys()) if recorded.get(k) != current.get(k) or
            (k in recorded) != (k in current)]
