"""What a checkpoint means, recorded with it and checked when a run resumes from it.

A checkpoint's weights and optimiser state only make sense for the run that wrote them: the same model (path,
parameter names and shapes, which of them train, the LoRA adapters), the same advantage estimator and loss,
the same data and group size. Each checkpoint's `meta.json` records these (`fingerprint`); a resume compares
them with its own config and model before loading anything, and refuses a difference with one message naming
each field, old and new value. Settings that change only how the rest of the run goes (its length, logging,
evaluation, checkpointing, the learning-rate schedule) may change: the differences are said and recorded as a
`resume_changes` event in events.jsonl. `checkpoint.resume_anyway: true` resumes despite a refused difference
(recorded the same way), except different parameter shapes, which cannot be loaded at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenmill.checkpoint.atomic import CheckpointError
from tokenmill.tracking import events

# what may change on resume without changing what the checkpoint means (compared and reported, never refused)
SAFE = (
    "controller.steps", "controller.max_steps_per_run", "controller.eval_every", "controller.eval_max_rows",
    "training.learning_rate", "training.lr_schedule", "training.warmup_steps", "training.max_grad_norm",
    "tracking.console", "tracking.log_every", "tracking.log_samples", "tracking.tensorboard", "tracking.wandb",
    "checkpoint.every", "checkpoint.keep_last", "checkpoint.save_final",
)
SHAPES = "model.parameters"  # cannot be overridden: the weights would not load


class ResumeMismatch(CheckpointError):
    """The checkpoint was written by a run that means something else; the message names the fields."""


def _dotted(cfg: Any, field: str) -> Any:
    value = cfg
    for part in field.split("."):
        value = getattr(value, part, None)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _model_identity(path: str) -> str:
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path  # a folder wherever it is named from; a hub id as is


def _tensors(named: list[tuple[str, torch.Size]]) -> str:
    """`N tensors, M values, sha256 <16 hex>` of (name, shape) pairs: equal exactly when names and shapes are."""
    digest = hashlib.sha256("\n".join(f"{n}:{tuple(s)}" for n, s in sorted(named)).encode()).hexdigest()[:16]
    total = sum(int(torch.Size(s).numel()) for _, s in named)
    return f"{len(named)} tensors, {total:,} values, sha256 {digest}"


def run_fingerprint(cfg: Any, model: torch.nn.Module) -> dict[str, Any]:
    """{"meaning": what a resume must match, "settings": the SAFE values} of the run `cfg` training `model`."""
    params = list(model.named_parameters())
    meaning = {
        "model.path": _model_identity(cfg.model.path),
        SHAPES: _tensors([(n, p.shape) for n, p in params]),
        "model.trainable": _tensors([(n, p.shape) for n, p in params if p.requires_grad]),
        "model.lora": _dotted(cfg, "model.lora"),
        "algorithm.advantage": cfg.algorithm.advantage,
        "algorithm.loss": cfg.algorithm.loss,
        "data.task": cfg.data.task,
        "data.path": cfg.data.path,
        "generation.group_size": cfg.generation.group_size,
    }
    return {"meaning": meaning, "settings": {f: _dotted(cfg, f) for f in SAFE}}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{field}: {old.get(field)!r} -> {new.get(field)!r}"
            for field in sorted(old.keys() | new.keys()) if old.get(field) != new.get(field)]


def resume_check(current: dict[str, Any], *, anyway: bool = False,
                 say: Callable[[str], None] | None = None) -> Callable[[Path, dict[str, Any] | None], None]:
    """The check `load_latest` runs on the checkpoint it is about to load (its path and recorded fingerprint,
    None for one written before fingerprints): raise ResumeMismatch for a change of meaning (unless `anyway`),
    else say the changes and record them as a `resume_changes` event."""

    def check(path: Path, recorded: dict[str, Any] | None) -> None:
        if recorded is None:
            return  # an older checkpoint: nothing to compare (a wrong shape still fails to load)
        meaning = _differences(recorded.get("meaning", {}), current["meaning"])
        settings = _differences(recorded.get("settings", {}), current["settings"])
        shapes = [d for d in meaning if d.startswith(f"{SHAPES}:")]
        if meaning and (not anyway or shapes):
            listing = "\n  ".join(meaning)
            advice = ("its weights cannot be loaded into this model" if shapes else
                      "resume with the checkpoint's settings, or set checkpoint.resume_anyway: true to go on anyway")
            raise ResumeMismatch(
                f"checkpoint.resume: {path} was written by a different run (checkpoint -> this config):\n  {listing}\n"
                f"The checkpoint is intact; {advice}, or start afresh in another tracking.output_dir.")
        if meaning or settings:
            events.emit("resume_changes", checkpoint=str(path), settings=settings, overridden=meaning)
            if say is not None:
                kind = "changed since the checkpoint" + (" (checkpoint.resume_anyway)" if meaning else "")
                say(f"resume: {kind}: {'; '.join(meaning + settings)}")

    return check
