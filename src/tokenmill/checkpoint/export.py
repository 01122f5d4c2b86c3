"""The model folder a run leaves behind: a plain HF folder any tool loads."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tokenmill.checkpoint.atomic import hold_point
from tokenmill.checkpoint.space import disk_error, tensor_bytes


def export_model(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """A plain HF folder any tool loads; with LoRA the adapters are merged into it (a copy: the training
    module keeps its adapters) and the adapter alone is saved in `path/adapter` for peft."""
    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(path / "adapter")
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    copy_processor_files(model, path)


# what a vision-language model's image processor keeps beside the weights (it travels with the model)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def copy_processor_files(model: torch.nn.Module, path: Path) -> None:
    """Copy the image processor's config from the folder the model was loaded from (`config._name_or_path`)."""
    source = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or ""))
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (Path(path) / name).exists():
            shutil.copyfile(source / name, Path(path) / name)


def export_atomic(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """`export_model` into a temporary sibling, fsynced, then renamed to `path`: a folder at `path` is
    always a complete export, so a resumed run can tell whether the export still has to be done."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for stale in path.parent.glob(f".tmp-{path.name}-*"):  # a killed export's leftovers
        shutil.rmtree(stale, ignore_errors=True)
    hold_point("export")  # the last checkpoint is saved, the export not begun
    try:
        export_model(model, tokenizer, tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_error(exc, path.parent, f"the export {path.name}/", tensor_bytes(model))
        if full is not None:
            raise full from None
        raise
    hold_point("export-rename")  # written in full, not renamed into place
    old = path.with_name(f".old-{path.name}-{os.getpid()}")
    if path.exists():  # a re-export (the run went on with more steps): the old one goes only after the swap
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
