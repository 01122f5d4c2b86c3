"""Atomic checkpoints: only complete folders are found, pruning after the save, exact weights and state."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random

import pytest
import torch

from tokenmill.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from tokenmill.training import LocalBackend


class Small(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(5, generator=g))


class NotAllowed:
    """Any class instance: weights_only loading must refuse it."""


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_save_layout_and_latest(tmp_path):
    path = save_checkpoint(tmp_path, 7, Small(0), {"step": 7})
    assert path == tmp_path / "step_00000007"
    assert _names(path) == ["meta.json", "model.safetensors", "trainer.pt"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["format"] == 2 and sorted(meta["files"]) == ["model.safetensors", "trainer.pt"]
    for name, info in meta["files"].items():
        assert info["bytes"] == (path / name).stat().st_size
        assert info["sha256"] == hashlib.sha256((path / name).read_bytes()).hexdigest()
    save_checkpoint(tmp_path, 12, Small(0), {"step": 12})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000012"
    assert _names(tmp_path) == ["step_00000007", "step_00000012"]  # nothing temporary left behind
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_incomplete_folders_are_never_picked(tmp_path):
    save_checkpoint(tmp_path, 3, Small(0), {})
    # a crash mid-save leaves a temporary folder, possibly complete-looking, with a higher step
    tmp = tmp_path / ".tmp-step_00000009-4242"
    tmp.mkdir()
    (tmp / "meta.json").write_text('{"step": 9}')
    # a folder with the final name but no meta.json (e.g. copied by hand, or written by an older version)
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "model.safetensors").write_bytes(b"partial")
    # a leftover from re-saving a step
    (tmp_path / ".old-step_00000011-4242").mkdir()
    (tmp_path / ".old-step_00000011-4242" / "meta.json").write_text('{"step": 11}')
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000003"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"


def test_steps_sort_numerically(tmp_path):
    for step in (9, 100, 10):
        save_checkpoint(tmp_path, step, Small(0), {}, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009", "step_00000010", "step_00000100"]


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, Small(step), {"step": step}, keep_last=2)
    assert _names(tmp_path) == ["step_00000003", "step_00000004"]


def test_keep_last_prunes_only_after_the_new_one_is_complete(tmp_path):
    save_checkpoint(tmp_path, 1, Small(1), {}, keep_last=2)
    save_checkpoint(tmp_path, 2, Small(2), {}, keep_last=2)
    # the save of step 3 fails half-way (trainer state cannot be written): nothing may be pruned yet
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(tmp_path, 3, Small(3), {"bad": lambda: None}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert _names(tmp_path) == ["step_00000001", "step_00000002"]  # the half-written folder is gone
    # a later successful save with keep_last=1 leaves only itself, and clears nothing it should not
    save_checkpoint(tmp_path, 3, Small(3), {}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]


def test_resaving_a_step_never_loses_it(tmp_path):
    save_checkpoint(tmp_path, 5, Small(1), {"v": torch.tensor(1)})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(tmp_path, 5, Small(2), {"bad": lambda: None})
    target = Small(9)
    _, state = load_checkpoint(latest_checkpoint(tmp_path), target)
    assert state["v"].item() == 1 and torch.equal(target.a, Small(1).a)
    save_checkpoint(tmp_path, 5, Small(2), {"v": torch.tensor(2)})
    _, state = load_checkpoint(latest_checkpoint(tmp_path), target)
    assert state["v"].item() == 2 and torch.equal(target.a, Small(2).a)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".tmp-")] == ["step_00000005"]


def test_load_restores_weights_exactly(tmp_path):
    saved = Small(0)
    path = save_checkpoint(tmp_path, 4, saved, {"data_position": 17, "lr": torch.tensor([0.5, 0.25])})
    target = Small(1)
    assert not torch.equal(target.a, saved.a)
    step, state = load_checkpoint(path, target)
    assert step == 4
    assert torch.equal(target.a, saved.a) and torch.equal(target.b, saved.b)
    assert state["data_position"] == 17 and torch.equal(state["lr"], torch.tensor([0.5, 0.25]))


def test_tiny_model_with_tied_embeddings_round_trips(tmp_path, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # differ from the folder the fresh copy comes from
    path = save_checkpoint(tmp_path, 1, model, {})
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    load_checkpoint(path, fresh)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied


def test_trainer_state_loads_with_weights_only_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model = Small(0)
    backend = LocalBackend(model, learning_rate=0.1, total_steps=10, warmup_steps=2, lr_schedule="cosine")

    def step():
        loss = (model.a.sum() ** 2 + (model.b * torch.arange(5.0)).sum())
        loss.backward()
        return backend.optim_step()

    step()
    random.seed(123)
    path = save_checkpoint(tmp_path, 1, model, {"backend": backend.state_dict(), "rng": rng_state(), "position": 3})
    expected_random = (random.random(), torch.rand(3))
    metrics = step()  # uninterrupted run continues
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # weights_only: the file holds only tensors and plain containers
    raw = torch.load(path / "trainer.pt", weights_only=True)
    assert raw["position"] == 3 and "optimizer" in raw["backend"] and "scheduler" in raw["backend"]

    resumed = Small(5)
    backend2 = LocalBackend(resumed, learning_rate=0.1, total_steps=10, warmup_steps=2, lr_schedule="cosine")
    step_no, state = load_checkpoint(path, resumed)
    backend2.load_state_dict(state["backend"])
    set_rng_state(state["rng"])
    assert step_no == 1
    assert random.random() == expected_random[0] and torch.equal(torch.rand(3), expected_random[1])
    loss = (resumed.a.sum() ** 2 + (resumed.b * torch.arange(5.0)).sum())
    loss.backward()
    metrics2 = backend2.optim_step()
    assert metrics2["lr"] == metrics["lr"]
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, after[name]), name


def test_load_refuses_arbitrary_pickles(tmp_path):
    path = save_checkpoint(tmp_path, 1, Small(0), {"obj": NotAllowed()})
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path, Small(0))


def test_foreign_step_folder_does_not_break_resume(tmp_path):
    path = save_checkpoint(tmp_path, 2, Small(0), {})
    backup = tmp_path / "step_00000002-backup"
    backup.mkdir()
    (backup / "meta.json").write_text(path.joinpath("meta.json").read_text())
    assert latest_checkpoint(tmp_path) == path


# ---------------------------------------------------------------------------------- damaged checkpoints


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


def _zero_tail(path):
    data = bytearray(path.read_bytes())
    data[-16:] = bytes(16)
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated model": lambda p: _truncate(p / "model.safetensors", lambda n: n // 2),
    "zero-byte model": lambda p: _truncate(p / "model.safetensors", lambda n: 0),
    "truncated trainer state": lambda p: _truncate(p / "trainer.pt", lambda n: n - 100),
    "garbage meta.json": lambda p: (p / "meta.json").write_bytes(b"\x00\xff{not json"),
    "last 16 bytes of the model zeroed": lambda p: _zero_tail(p / "model.safetensors"),
}
WHY = {
    "truncated model": "model.safetensors has",
    "zero-byte model": "model.safetensors has 0 bytes",
    "truncated trainer state": "trainer.pt has",
    "garbage meta.json": "meta.json unreadable",
    "last 16 bytes of the model zeroed": "model.safetensors does not match its SHA-256",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_falls_back_to_the_previous_one(tmp_path, damage):
    save_checkpoint(tmp_path, 1, Small(1), {"v": torch.tensor(1)})
    newest = save_checkpoint(tmp_path, 2, Small(2), {"v": torch.tensor(2)})
    DAMAGE[damage](newest)
    assert verify_checkpoint(newest).startswith(WHY[damage])
    warnings: list[str] = []
    target = Small(9)
    path, step, state = load_latest(tmp_path, target, warn=warnings.append)
    assert (path.name, step, state["v"].item()) == ("step_00000001", 1, 1)
    assert torch.equal(target.a, Small(1).a) and torch.equal(target.b, Small(1).b)
    assert len(warnings) == 1 and "step_00000002 is unusable" in warnings[0] and WHY[damage] in warnings[0]
    # the bad one is kept for inspection but no longer listed
    assert _names(tmp_path) == [".corrupt-step_00000002", "step_00000001"]
    # the run goes on and saves step 2 again: a normal checkpoint, found next time without warnings
    save_checkpoint(tmp_path, 2, Small(3), {"v": torch.tensor(3)})
    warnings.clear()
    assert load_latest(tmp_path, target, warn=warnings.append)[1] == 2 and warnings == []


def test_every_checkpoint_damaged_is_one_clear_error(tmp_path):
    first = save_checkpoint(tmp_path, 1, Small(1), {})
    second = save_checkpoint(tmp_path, 2, Small(2), {})
    DAMAGE["zero-byte model"](first)
    DAMAGE["garbage meta.json"](second)
    with pytest.raises(CheckpointError) as info:
        load_latest(tmp_path, Small(0), warn=lambda _: None)
    text = str(info.value)
    assert text.startswith(f"no usable checkpoint in {tmp_path}; every one found is damaged:")
    assert f"{second}: meta.json unreadable" in text and f"{first}: model.safetensors has 0 bytes" in text
    assert info.value.exit_code == 2
    assert _names(tmp_path) == ["step_00000001", "step_00000002"]  # nothing moved: a rerun says the same


def test_no_checkpoint_is_none_and_old_format_still_loads(tmp_path):
    assert load_latest(tmp_path / "absent", Small(0)) is None
    path = save_checkpoint(tmp_path, 4, Small(4), {"v": torch.tensor(4)})
    (path / "meta.json").write_text('{"step": 4}')  # written before checksums were recorded
    assert verify_checkpoint(path) is None
    target = Small(0)
    assert load_latest(tmp_path, target)[1] == 4 and torch.equal(target.a, Small(4).a)
    (path / "trainer.pt").write_bytes(b"garbage")  # no checksum to catch it: the failed load does
    with pytest.raises(CheckpointError, match="trainer.pt|cannot be loaded"):
        load_latest(tmp_path, target, warn=lambda _: None)


def test_leftovers_of_a_killed_writer_are_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, Small(1), {})
    dead = 2**22 + 12345  # above pid_max's default: no such process
    (tmp_path / f".tmp-step_00000002-{dead}").mkdir()
    (tmp_path / f".tmp-step_00000002-{dead}" / "model.safetensors").write_bytes(b"half")
    # killed between moving the old copy of step 1 aside and renaming the new one in: the old is the only copy
    (tmp_path / "step_00000001").rename(tmp_path / f".old-step_00000001-{dead}")
    warnings: list[str] = []
    target = Small(0)
    assert load_latest(tmp_path, target, warn=warnings.append)[1] == 1
    assert torch.equal(target.a, Small(1).a)
    assert _names(tmp_path) == ["step_00000001"]
    assert sorted(warnings) == [
        f"checkpoints: removed .tmp-step_00000002-{dead} (left by an interrupted save)",
        f"checkpoints: restored step_00000001 from .old-step_00000001-{dead} (interrupted re-save)",
    ]
    # a fresh run (no resume) cleans them at its first save
    (tmp_path / f".tmp-step_00000005-{dead}").mkdir()
    save_checkpoint(tmp_path, 2, Small(2), {})
    assert _names(tmp_path) == ["step_00000001", "step_00000002"]


def test_pruning_keeps_the_new_checkpoint_beside_a_newer_bad_one(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, Small(step), {}, keep_last=3)
    # after a fallback from step 3 the run saves step 2 again with keep_last=1: step 3 (newer) must not
    # count as "the last one kept" and get the fresh step 2 deleted
    save_checkpoint(tmp_path, 2, Small(5), {}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]


def test_a_kill_mid_prune_leaves_no_half_deleted_step_folder(tmp_path, monkeypatch):
    """Pruning renames a checkpoint aside before deleting it: a writer killed after deleting the old weights (its
    meta.json still there) leaves a `.pruned-` folder, which the next save tidies, never a `step_*` one."""
    import shutil

    from tokenmill.checkpoint import atomic, clean_stale

    save_checkpoint(tmp_path, 1, Small(1), {}, keep_last=1)
    real = shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):
        if (path / "meta.json").is_file():  # a complete checkpoint being pruned: the weights go first, then death
            (path / "model.safetensors").unlink()
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(atomic.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, Small(2), {}, keep_last=1)
    monkeypatch.setattr(atomic.shutil, "rmtree", real)
    steps = [p for p in tmp_path.iterdir() if p.name.startswith("step_")]
    assert [p.name for p in steps] == ["step_00000002"] and all(verify_checkpoint(p) is None for p in steps)
    assert clean_stale(tmp_path) == [(f"removed .pruned-step_00000001-{os.getpid()} "
                                     "(left by an interrupted save)")]
    assert _names(tmp_path) == ["step_00000002"]
