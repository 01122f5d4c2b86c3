"""Atomic checkpoints, exact resume, Hugging Face export."""

from tokenmill.checkpoint.atomic import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
