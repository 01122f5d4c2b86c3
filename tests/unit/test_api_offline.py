"""`tokenmill.sft`, `tokenmill.preference` and `tokenmill.reward_model`: a config (dict, YAML path or config
object) trains a tiny model, its loss falls and the trained folder is written; wrong arguments are
`ConfigError`s naming them."""

from __future__ import annotations

import json

import pytest
import yaml

import tokenmill
from tokenmill.config import PreferenceConfig, SFTConfig
from tokenmill.types import ConfigError


def _fell(losses: list[float], by: float) -> bool:
    """The mean of the last five losses is below `by` times the mean of the first five."""
    return sum(losses[-5:]) / 5 < by * sum(losses[:5]) / 5


def test_sft_trains_from_a_dict_and_writes_the_model(tiny_model_path, tmp_path):
    out = tmp_path / "sft"
    result = tokenmill.sft({"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_train": 64},
                            "steps": 20, "batch_size": 16, "learning_rate": 1e-2, "warmup_steps": 2,
                            "output_dir": str(out)})
    assert len(result["losses"]) == 20 and result["output_dir"] == str(out)
    assert _fell(result["losses"], 0.7), result["losses"]
    assert json.loads((out / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 20  # the run's rows, as an RL run writes


def test_sft_takes_a_yaml_path_a_config_object_and_overrides_alike(tiny_model_path, tmp_path):
    tree = {"model": {"path": tiny_model_path}, "data": {"task": "addition", "num_train": 16}, "steps": 3,
            "batch_size": 4, "learning_rate": 1e-2, "output_dir": str(tmp_path / "a")}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(tree))
    from_yaml = tokenmill.sft(path)["losses"]
    from_object = tokenmill.sft(SFTConfig.model_validate({**tree, "learning_rate": 0.5}), learning_rate=1e-2,
                                output_dir=str(tmp_path / "b"))["losses"]
    assert from_object == from_yaml  # the same run: same seed, same losses


def test_preference_dpo_trains_and_reports_held_out_pairs(tiny_model_path, tmp_path):
    result = tokenmill.preference({"model": {"path": tiny_model_path}, "objective": "dpo",
                                   "data": {"task": "addition", "num_train": 64, "num_eval": 16}, "steps": 15,
                                   "batch_size": 16, "learning_rate": 1e-2, "warmup_steps": 0,
                                   "output_dir": str(tmp_path / "dpo")})
    assert result["objective"] == "dpo"
    assert result["losses"][0] == pytest.approx(0.6931, abs=1e-3)  # the policy is its own reference at step 1
    assert _fell(result["losses"], 0.95), result["losses"]
    assert 0.0 <= result["heldout_chosen_preferred"] <= 1.0 and "heldout_margin" in result


def test_reward_model_trains_a_classifier(tiny_model_path, tmp_path):
    out = tmp_path / "rm"
    result = tokenmill.reward_model({"model": {"path": tiny_model_path}, "steps": 60, "batch_size": 16,
                                     "data": {"task": "addition", "num_train": 64, "num_eval": 32},
                                     "learning_rate": 3e-3, "warmup_steps": 0, "output_dir": str(out)})
    assert result["objective"] == "reward_model" and len(result["losses"]) == 60
    assert _fell(result["losses"], 0.9), result["losses"]
    assert json.loads((out / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")


@pytest.mark.parametrize("call, config, message", [
    (tokenmill.sft, 42, "config: expected a config (SFTConfig), a dict of sections or a YAML path, not int"),
    (tokenmill.preference, [1],
     "config: expected a config (PreferenceConfig), a dict of sections or a YAML path, not list"),
    (tokenmill.sft, {"model": {"path": "m"}, "data": {"task": "addition"}, "learning_rate": 2.0},
     "learning_rate: Input should be less than or equal to 1 (got 2.0)"),
    (tokenmill.reward_model, {"model": {"path": "m"}, "data": {"task": "addition"}, "objective": "dpo"},
     "objective: mode reward_model fixes it to 'reward_model' (got 'dpo')"),
    (tokenmill.sft, PreferenceConfig.model_validate({"model": {"path": "m"}, "data": {"task": "addition"}}),
     "config: expected a config (SFTConfig), a dict of sections or a YAML path, not PreferenceConfig"),
])
def test_wrong_arguments_are_config_errors(call, config, message):
    with pytest.raises(ConfigError) as err:
        call(config)
    assert str(err.value).startswith(message)


def test_the_data_columns_are_checked_before_the_model_loads(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"completion_column: column 'completion' not in the dataset \(columns: "):
        tokenmill.sft({"model": {"path": "org/model"}, "data": {"path": str(data)}})
