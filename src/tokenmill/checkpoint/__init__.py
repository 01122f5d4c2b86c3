"""Atomic, verified checkpoints, exact resume, Hugging Face export."""

from tokenmill.checkpoint.atomic import (
    CheckpointError,
    clean_stale,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "clean_stale",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]
