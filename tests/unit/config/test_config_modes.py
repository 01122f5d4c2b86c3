"""One mode table and one mode inference for the trainers, `tokenmill estimate` and the Composer; one YAML
(with `mode:` and `estimate:`) read by `tokenmill train` and `tokenmill estimate` alike; and the estimate
CLI without the Composer package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tokenmill.cli import main
from tokenmill.composer.configs import import_yaml
from tokenmill.config import PreferenceConfig, RLConfig, SFTConfig, load_config
from tokenmill.config.modes import MODES, infer_mode
from tokenmill.estimate import estimate_for_config
from tokenmill.types import ConfigError

BASE = {"model": {"path": "Qwen/Qwen2.5-0.5B"}, "data": {"task": "addition"}}


@pytest.mark.parametrize("extra,expected", [
    ({}, "rl"),
    ({"controller": {"steps": 3}}, "rl"),
    ({"steps": 3}, "sft"),
    ({"packing": True}, "sft"),
    ({"objective": "ipo"}, "preference"),
    ({"beta": 0.2}, "preference"),
    ({"objective": "reward_model"}, "reward_model"),
    ({"mode": "preference", "steps": 3}, "preference"),  # a DPO config with default objective and beta
    ({"mode": "reward_model", "steps": 3}, "reward_model"),
])
def test_estimate_and_composer_read_the_same_mode(extra, expected):
    tree = {**BASE, **extra}
    assert infer_mode(tree)[0] == expected
    assert estimate_for_config(tree)["mode"] == expected
    imported = import_yaml(yaml.safe_dump(tree))
    assert (imported["mode"], imported["errors"]) == (expected, [])
    if expected == "reward_model":
        assert imported["config"]["objective"] == "reward_model"


def test_bad_mode_names_the_field():
    with pytest.raises(ConfigError, match=r"^mode: must be one of rl, preference, reward_model, sft \(got 'ppo'\)"):
        estimate_for_config({**BASE, "mode": "ppo"})
    assert import_yaml("mode: ppo\n")["errors"] == [
        {"path": "mode", "message": "must be one of rl, preference, reward_model, sft (got 'ppo')"}]


def test_one_yaml_serves_train_and_estimate(tmp_path, capsys):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({"mode": "rl", **BASE, "algorithm": {"kl_coef": 0.01},
                                    "estimate": {"gradient_checkpointing": True, "device_memory_gib": 24}}))
    cfg = load_config(RLConfig, path)  # what `tokenmill train` reads
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B" and cfg.algorithm.kl_coef == 0.01
    assert main(["validate", str(path)]) == 0
    assert "grpo" in capsys.readouterr().out.lower()
    assert main(["estimate", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "rl" and result["settings"]["gradient_checkpointing"] is True
    assert result["devices"][0]["budget_bytes"] == 24 * 2**30
    sft = {"mode": "sft", **BASE, "steps": 3, "estimate": {"seq_len": 128}}
    assert load_config(SFTConfig, sft).steps == 3
    assert estimate_for_config(sft)["settings"]["seq_len"] == 128


def test_train_refuses_another_modes_yaml(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^mode: a sft config is trained with `tokenmill sft`"):
        load_config(RLConfig, {"mode": "sft", **BASE})
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"mode": "sft", **BASE, "steps": 3}))
    assert main(["train", str(path)]) == 2
    assert "mode: a sft config is trained with `tokenmill sft`" in capsys.readouterr().err
    # reward_model is PreferenceConfig with its objective fixed by the mode
    assert load_config(PreferenceConfig, {"mode": "reward_model", **BASE}).objective == "reward_model"
    with pytest.raises(ConfigError, match=r"^objective: mode reward_model fixes it to 'reward_model' \(got 'dpo'\)"):
        load_config(PreferenceConfig, {"mode": "reward_model", **BASE, "objective": "dpo"})


def test_mode_table_names_each_trainer():
    assert {m.id: (m.command, m.schema) for m in MODES.values()} == {
        "rl": ("train", RLConfig), "preference": ("preference", PreferenceConfig),
        "reward_model": ("preference", PreferenceConfig), "sft": ("sft", SFTConfig)}


def test_estimate_cli_imports_neither_the_composer_nor_torch(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(BASE))
    code = ("import json, sys\nfrom tokenmill.cli import main\n"
            f"assert main(['estimate', {str(path)!r}, '--json']) == 0\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('tokenmill', 'torch'))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "tokenmill.estimate" in modules
    assert [m for m in modules if m.startswith(("tokenmill.composer", "torch"))] == []
