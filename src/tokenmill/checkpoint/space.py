"""A run folder that cannot be written (full disk, quota, read-only, no permission): one line, exit status 2.

A full disk mid-run used to end in a torch or OSError traceback. Writes of the run folder (its lock, each
checkpoint, the final export) turn such a failure into a `DiskError` naming the folder, the reason, the space
the write needs and the space free there; the half-written checkpoint is removed and older ones stay, so the
run resumes once there is room. Before the model loads, `check_free_space` compares the free space with the
size of one checkpoint and the export, predicted from the model's `config.json` by the memory estimator's
parameter count (4 bytes a weight, plus 8 for the two Adam moments of each weight that trains).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import torch

from tokenmill.types import TokenmillError

REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted"}
# how torch's and safetensors' writers word the same failures (their errors carry no errno)
TEXTS = {"No space left on device": errno.ENOSPC, "file write failed": errno.ENOSPC,
         "Disk quota exceeded": errno.EDQUOT, "Read-only file system": errno.EROFS}


class DiskError(TokenmillError):
    """The run folder cannot be written; the message names it, why, and the space needed and free."""

    exit_code = 2  # the user must make room (or change tracking.output_dir), then resume


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


def free_bytes(folder: str | Path) -> int:
    """Free space (for this user) on the file system `folder` is or would be created on."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def write_problem(exc: BaseException) -> str | None:
    """Why a write failed, when it is the folder's fault (space, quota, read-only, permission), else None."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None:
        code = next((c for text, c in TEXTS.items() if text in str(exc)), None)
    return REASONS.get(code) if code is not None else None


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (a module's parameters, or a state dict's nested tensors)."""
    if isinstance(obj, torch.nn.Module):
        return sum(p.numel() * p.element_size() for p in obj.parameters())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def disk_error(exc: BaseException, folder: str | Path, what: str, needed: int | None = None) -> DiskError | None:
    """The DiskError `exc` stands for when writing `what` into `folder`, or None when it is another failure."""
    why = write_problem(exc)
    if why is None:
        return None
    need = f"it needs about {human(needed)}, " if needed else ""
    try:
        free = f"{need}{human(free_bytes(folder))} free there"
    except OSError:
        free = need.rstrip(", ")
    return DiskError(f"cannot write {what} in {folder}: {why} ({free}); make room or point tracking.output_dir "
                     "elsewhere, then resume with checkpoint.resume: true")


def checkpoint_estimate(cfg: Any) -> tuple[int, int] | None:
    """(bytes of one checkpoint, bytes of the final export) of `cfg`'s policy, from its local config.json; None
    when its shape is not known (a hub id, an architecture the estimator does not model)."""
    from tokenmill.estimate.model_specs import resolve_shape

    if not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        return None
    try:
        params = resolve_shape(cfg.model.path).num_params
    except (ValueError, KeyError, TypeError):
        return None
    trains = 0 if cfg.model.lora.rank else params  # LoRA: the adapters' moments are small beside the weights
    return params * 4 + trains * 8, params * 4


def check_free_space(cfg: Any) -> None:
    """Before the model loads: refuse a run whose output folder cannot hold one checkpoint and the export."""
    saves = cfg.checkpoint.every or cfg.checkpoint.save_final
    sizes = checkpoint_estimate(cfg) if saves else None
    if sizes is None:
        return
    one, export = sizes
    folder = cfg.tracking.output_dir
    free = free_bytes(folder)
    if free < one + export:
        raise DiskError(f"tracking.output_dir: {folder} has {human(free)} free; a checkpoint of this model takes "
                        f"about {human(one)} and the final export {human(export)}: make room or choose another "
                        "folder")
