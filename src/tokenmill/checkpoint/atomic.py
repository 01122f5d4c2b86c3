"""Atomic, verified checkpoints and exact resume.

A checkpoint is a folder `step_XXXXXXXX/` holding `model.safetensors` (weights), `trainer.pt`
(optimiser, scheduler, RNG states, data position: loaded with `weights_only=True`, never arbitrary
pickle) and `meta.json` (the step, the size and SHA-256 of each other file, and the run's fingerprint:
`checkpoint.fingerprint`). It is written under a temporary name, every file fsynced, then renamed into place;
only after that are older checkpoints pruned, each renamed aside (`.pruned-step_*`) before it is deleted, so a
`step_*` folder is always complete or absent. A folder without `meta.json` is never loaded.

Why checksums: a renamed folder is complete when it was written, but a disk, a copy or a hand edit can
still damage it later, and safetensors loads a file whose last bytes were zeroed without complaint (the
run then silently diverges). `load_latest` verifies before loading and falls back to the newest
checkpoint that verifies, moving the bad ones aside as `.corrupt-step_*` (kept for inspection).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from tokenmill.checkpoint.space import disk_error, tensor_bytes
from tokenmill.types import TokenmillError

log = logging.getLogger("tokenmill.checkpoint")
PREFIX = "step_"
FORMAT = 2  # 1: meta.json held only the step; 2: sizes and SHA-256 of every file
PAYLOAD = ("model.safetensors", "trainer.pt")
CHUNK = 1 << 22


class CheckpointError(TokenmillError):
    """No checkpoint can be resumed from; the message names each one found and what is wrong with it."""

    exit_code = 2  # the CLI's exit status: like a bad config, something the user must fix before rerunning


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])


def hold_point(name: str) -> None:
    """Crash tests: with TOKENMILL_TEST_HOLD=<name> the writer says so on stderr and sleeps at this point,
    so a test can SIGKILL it exactly there (`tokenmill.testing.crash`). Unset in normal use."""
    if os.environ.get("TOKENMILL_TEST_HOLD") == name:
        import sys
        import time

        print(f"tokenmill-test: holding at {name}", file=sys.stderr, flush=True)
        time.sleep(3600)


def checkpoint_name(step: int) -> str:
    """The folder name of step `step`'s checkpoint."""
    return f"{PREFIX}{step:08d}"


def clean_stale(root: str | Path) -> list[str]:
    """Tidy what a killed writer left in `root`; return what was done, one line each.

    `.tmp-step_*` folders of a writer that is gone are half-written, `.pruned-step_*` ones half-deleted: both
    deleted. `.old-step_*` is the previous
    copy of a step being re-saved; if the writer died before the new copy took its place, it is the only
    copy, so it is renamed back rather than deleted."""
    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    leftovers = [sorted(root.glob(f".{kind}-{PREFIX}*")) for kind in ("tmp", "pruned", "old")]
    for leftover in leftovers[0] + leftovers[1] + leftovers[2]:
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue  # another live process is writing (should not happen: one run per folder)
        if leftover.name.startswith(".old-"):
            target = root / leftover.name[len(".old-") :].rsplit("-", 1)[0]
            if not target.exists():
                leftover.rename(target)
                done.append(f"restored {target.name} from {leftover.name} (interrupted re-save)")
                continue
        shutil.rmtree(leftover, ignore_errors=True)
        done.append(f"removed {leftover.name} (left by an interrupted save)")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_checkpoint(
    root: str | Path, step: int, model: torch.nn.Module, trainer_state: dict[str, Any], keep_last: int = 2,
    fingerprint: dict[str, Any] | None = None,
) -> Path:
    """Write step `step`'s checkpoint under `root` (atomically), then prune older ones to `keep_last`.
    `fingerprint`: what the checkpoint means (`checkpoint.fingerprint.run_fingerprint`), kept in meta.json."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / "model.safetensors"))
        hold_point(f"checkpoint-model@{step}")  # weights written, trainer state not
        torch.save(trainer_state, tmp / "trainer.pt")
        files = {}
        for name in PAYLOAD:
            _fsync_path(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        meta = {"step": step, "format": FORMAT, "files": files}
        if fingerprint is not None:
            meta["fingerprint"] = fingerprint
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _fsync_path(tmp / "meta.json")
        _fsync_path(tmp)
        hold_point(f"checkpoint-rename@{step}")  # complete, not renamed into place
    except BaseException as exc:  # disk full, interrupted: leave no half-written folder behind (older ones stay)
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_error(exc, root, f"checkpoint {final.name}", tensor_bytes(model) + tensor_bytes(trainer_state))
        if full is not None:  # one line naming the folder and the space, not a torch traceback
            raise full from None
        raise
    if final.exists():  # re-saving the same step: move the old one aside first, never delete it first
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_path(root)
    # prune only older steps: a newer folder is one a resume fell back from, never worth more than this one
    older = [p for p in list_checkpoints(root) if _step_of(p) < step]
    for stale in older[: max(0, len(older) - (keep_last - 1))]:
        # renamed aside first: a kill mid-delete leaves a `.pruned-` folder (tidied later), never a `step_*` one
        # without its weights
        aside = root / f".pruned-{stale.name}-{os.getpid()}"
        stale.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    return final


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p for p in root.glob(f"{PREFIX}*")
        if p.name[len(PREFIX) :].isdigit() and (p / "meta.json").is_file()
    ]
    return sorted(done, key=_step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def verify_checkpoint(path: str | Path) -> str | None:
    """What is wrong with the checkpoint at `path`, or None when every file matches its recorded checksum.

    Format-1 checkpoints (no checksums) are checked for presence only; loading them is the real test."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"meta.json unreadable ({type(exc).__name__}: {str(exc)[:80]})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or meta["step"] != _step_of(path):
        return f"meta.json does not record step {_step_of(path)}"
    files = meta.get("files")
    if files is None:
        missing = [name for name in PAYLOAD if not (path / name).is_file()]
        return f"missing {', '.join(missing)}" if missing else None
    if not isinstance(files, dict) or set(files) != set(PAYLOAD):
        return "meta.json lists the wrong files"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size} bytes, {want.get('bytes')} were written"
        if file_sha256(file) != want.get("sha256"):
            return f"{name} does not match its SHA-256 (damaged after it was written)"
    return None


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> tuple[int, dict[str, Any]]:
    """Load weights into `model`; return (step, trainer_state). No checksum check: see `load_latest`."""
    path = Path(path)
    step = json.loads((path / "meta.json").read_text())["step"]
    load_model(model, str(path / "model.safetensors"))
    state = torch.load(path / "trainer.pt", weights_only=True)
    return step, state


def load_latest(
    root: str | Path, model: torch.nn.Module, warn: Callable[[str], None] | None = None,
    check: Callable[[Path, dict[str, Any] | None], None] | None = None,
) -> tuple[Path, int, dict[str, Any]] | None:
    """Load the newest checkpoint under `root` that verifies and loads; None when there is none at all.

    Each bad newer one is reported through `warn` (default: the `tokenmill.checkpoint` logger), naming it
    and what is wrong, and once a good one has loaded it is moved aside to `.corrupt-<name>`, so later
    saves and resumes do not trip on it again. CheckpointError when checkpoints exist but not one of them
    is usable (then nothing is moved: a rerun reports the same). `check` is called with a checkpoint that
    verifies and its recorded fingerprint (None if it has none) before its weights are loaded: it raises to
    refuse it (`checkpoint.fingerprint.resume_check`: a run of another model, algorithm or data)."""
    warn = warn or log.warning
    root = Path(root)
    for line in clean_stale(root):
        warn(f"checkpoints: {line}")
    found = list_checkpoints(root)
    if not found:
        return None
    bad: list[tuple[Path, str]] = []
    for path in reversed(found):
        problem = verify_checkpoint(path)
        if problem is None and check is not None:
            check(path, json.loads((path / "meta.json").read_text()).get("fingerprint"))
        if problem is None:
            try:
                step, state = load_checkpoint(path, model)
            except Exception as exc:  # noqa: BLE001 - any failure to load means: try the previous one
                problem = f"cannot be loaded ({type(exc).__name__}: {str(exc)[:120]})"
        if problem is not None:
            bad.append((path, problem))
            continue
        for damaged, why in bad:
            aside = root / f".corrupt-{damaged.name}"
            shutil.rmtree(aside, ignore_errors=True)
            damaged.rename(aside)
            warn(f"checkpoint {damaged} is unusable: {why}; moved to {aside.name}, resuming from {path.name}")
        return path, step, state
    listing = "\n  ".join(f"{path}: {why}" for path, why in bad)
    raise CheckpointError(
        f"no usable checkpoint in {root}; every one found is damaged:\n  {listing}\n"
        "Start over without checkpoint.resume (or with a fresh tracking.output_dir), or restore the "
        "checkpoints folder from a backup."
    )
