"""Atomic checkpoints and exact resume.

A checkpoint is a folder `step_XXXXXXXX/` holding `model.safetensors` (weights), `trainer.pt`
(optimiser, scheduler, RNG states, data position: loaded with `weights_only=True`, never arbitrary
pickle) and `meta.json`. It is written under a temporary name, every file fsynced, then renamed into
place; only after that are older checkpoints pruned. A folder without `meta.json` is never loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

PREFIX = "step_"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    root: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any], keep_last: int = 2
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step}))
        for f in tmp.iterdir():
            _fsync_path(f)
        _fsync_path(tmp)
    except BaseException:  # disk full, interrupted: leave no half-written folder behind (older ones stay)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # re-saving the same step: move the old one aside first, never delete it first
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_path(root)
    for stale in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p for p in root.glob(f"{PREFIX}*")
        if p.name[len(PREFIX) :].isdigit() and (p / "meta.json").is_file()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> tuple[int, dict[str, Any]]:
    """Load weights into `model`; return (step, trainer_state)."""
    path = Path(path)
    step = json.loads((path / "meta.json").read_text())["step"]
    load_model(model, str(path / "model.safetensors"))
    state = torch.load(path / "trainer.pt", weights_only=True)
    return step, state
