"""The resume check: a change of meaning is refused naming each field; safe changes are said and recorded."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.checkpoint.fingerprint import SAFE, ResumeMismatch, resume_check, run_fingerprint
from tokenmill.config import RLConfig
from tokenmill.tracking import events


def _cfg(model_path: str, **sections) -> RLConfig:
    tree = {"model": {"path": model_path}, "data": {"task": "addition"}, **sections}
    return RLConfig.model_validate(tree)


def test_fingerprint_records_meaning_and_safe_settings(tmp_path):
    net = torch.nn.Linear(3, 2)
    net.bias.requires_grad_(False)
    fp = run_fingerprint(_cfg(str(tmp_path)), net)
    meaning = fp["meaning"]
    assert meaning["model.path"] == str(tmp_path.resolve()) and meaning["generation.group_size"] == 8
    assert meaning["model.parameters"].startswith("2 tensors, 8 values, sha256 ")
    assert meaning["model.trainable"].startswith("1 tensors, 6 values, sha256 ")
    assert meaning["algorithm.advantage"] == "grpo" and meaning["data.task"] == "addition"
    assert set(fp["settings"]) == set(SAFE) and fp["settings"]["controller.steps"] == 100
    # another shape of the same tensor count is another fingerprint
    other = run_fingerprint(_cfg(str(tmp_path)), torch.nn.Linear(2, 3))["meaning"]["model.parameters"]
    assert other != meaning["model.parameters"] and other.startswith("2 tensors, 9 values")
    assert json.loads(json.dumps(fp)) == fp  # kept in meta.json


def _fp(**meaning):
    base = {"model.path": "/m", "model.parameters": "2 tensors, 8 values, sha256 aa", "generation.group_size": 4}
    return {"meaning": base | meaning, "settings": {"controller.steps": 10}}


def test_a_change_of_meaning_is_refused_naming_each_field(tmp_path):
    check = resume_check(_fp(**{"generation.group_size": 8, "model.path": "/n"}))
    with pytest.raises(ResumeMismatch) as refused:
        check(tmp_path, _fp())
    text = str(refused.value)
    assert "generation.group_size: 4 -> 8" in text and "model.path: '/m' -> '/n'" in text
    assert "checkpoint.resume_anyway: true" in text and refused.value.exit_code == 2
    resume_check(_fp())(tmp_path, None)  # a checkpoint written before fingerprints: nothing to compare


def test_safe_changes_and_overrides_are_said_and_recorded(tmp_path):
    log = events.EventLog(tmp_path / "events.jsonl")
    events.activate(log)
    said: list[str] = []
    try:
        current = _fp(**{"generation.group_size": 8}) | {"settings": {"controller.steps": 20}}
        resume_check(current, anyway=True, say=said.append)(tmp_path / "step_1", _fp())
        with pytest.raises(ResumeMismatch, match="cannot be loaded into this model"):  # never overridden
            resume_check(_fp(**{"model.parameters": "x"}), anyway=True)(tmp_path, _fp())
    finally:
        events.deactivate(log)
        log.close()
    assert said == [("resume: changed since the checkpoint (checkpoint.resume_anyway): "
                    "generation.group_size: 4 -> 8; controller.steps: 10 -> 20")]
    (row,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert row["event"] == "resume_changes" and row["checkpoint"] == str(tmp_path / "step_1")
    assert row["settings"] == ["controller.steps: 10 -> 20"]
    assert row["overridden"] == ["generation.group_size: 4 -> 8"]


def test_load_latest_runs_the_check_before_loading_weights(tmp_path):
    from tokenmill.checkpoint import load_latest, save_checkpoint

    save_checkpoint(tmp_path, 1, torch.nn.Linear(3, 2), {"x": 1}, fingerprint=_fp())
    seen = []
    assert load_latest(tmp_path, torch.nn.Linear(3, 2), check=lambda p, f: seen.append((p.name, f)))[1] == 1
    assert seen == [("step_00000001", _fp())]
    with pytest.raises(ResumeMismatch, match="model.parameters"):  # not "damaged": the check comes first
        load_latest(tmp_path, torch.nn.Linear(2, 3), check=resume_check(_fp(**{"model.parameters": "y"})))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
