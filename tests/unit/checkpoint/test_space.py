"""A full disk, a quota or a read-only run folder is one line naming the folder and the space, exit 2."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tokenmill.checkpoint import atomic, latest_checkpoint, save_checkpoint, space
from tokenmill.checkpoint.lock import lock_run_folder
from tokenmill.checkpoint.space import DiskError, check_free_space, checkpoint_estimate
from tokenmill.config import RLConfig


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),  # torch.save's wording: no errno
], ids=["oserror", "torch"])
def test_a_full_disk_at_the_write_is_one_line_and_the_older_checkpoint_stays(tmp_path, monkeypatch, failure):
    model = torch.nn.Linear(10, 10)  # 110 floats: 440 bytes, plus the state's 4 bytes
    save_checkpoint(tmp_path, 1, model, {"x": torch.tensor(1.0)})

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(atomic.torch, "save", full)
    monkeypatch.setattr(space, "free_bytes", lambda folder: 123_000)
    with pytest.raises(DiskError) as refused:
        save_checkpoint(tmp_path, 2, model, {"x": torch.tensor(1.0)})
    assert str(refused.value) == (
        f"cannot write checkpoint step_00000002 in {tmp_path}: no space left on device (it needs about 444 bytes, "
        "123.0 KB free there); make room or point tracking.output_dir elsewhere, then resume with "
        "checkpoint.resume: true")
    assert refused.value.exit_code == 2 and refused.value.__cause__ is None
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # the half-written one is gone


def test_other_failures_are_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("something else")

    monkeypatch.setattr(atomic.torch, "save", broken)
    with pytest.raises(ValueError, match="something else"):
        save_checkpoint(tmp_path, 1, torch.nn.Linear(2, 2), {})


def test_a_read_only_run_folder_is_refused_when_the_lock_is_taken(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "open", read_only)  # as on a read-only mount (chmod does not stop root)
    with pytest.raises(DiskError, match=f"cannot write the run's lock file in {tmp_path}: read-only file system"):
        lock_run_folder(tmp_path)


def test_free_space_is_checked_against_the_predicted_checkpoint_before_the_model_loads(tmp_path, monkeypatch,
                                                                                     tiny_model_path, tiny_model):
    cfg = RLConfig.model_validate({"model": {"path": tiny_model_path}, "data": {"task": "addition"},
                                   "tracking": {"output_dir": str(tmp_path / "run")}})
    one, export = checkpoint_estimate(cfg)
    params = sum(p.numel() for p in tiny_model.parameters())
    assert (one, export) == (params * 12, params * 4)  # weights and two Adam moments, fp32; the export's weights
    monkeypatch.setattr(space, "free_bytes", lambda folder: one + export)
    check_free_space(cfg)  # just fits
    monkeypatch.setattr(space, "free_bytes", lambda folder: one + export - 1)
    with pytest.raises(DiskError, match=f"tracking.output_dir: {tmp_path / 'run'} has .* free; a checkpoint of "
                                        "this model takes about"):
        check_free_space(cfg)
    lora = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(
        update={"rank": 4})})})
    assert checkpoint_estimate(lora) == (params * 4, params * 4)
    nothing_saved = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
        update={"every": 0, "save_final": False})})
    check_free_space(nothing_saved)
