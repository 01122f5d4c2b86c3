"""`tokenmill preference`: DPO and reward-model runs from a config, with held-out numbers in the output."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import main


@pytest.mark.parametrize("objective", ["dpo", "simpo", "reward_model"])
def test_preference_command_runs_and_writes_a_model(tiny_model_path, tmp_path, objective, capsys):
    out = tmp_path / "out"
    argv = ["preference", "--model.path", tiny_model_path, "--data.task", "addition", "--data.num_train", "40",
            "--data.num_eval", "20", "--objective", objective, "--steps", "3", "--batch_size", "4",
            "--output_dir", str(out)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["objective"] == objective
    key = "heldout_pairwise_accuracy" if objective == "reward_model" else "heldout_chosen_preferred"
    assert 0.0 <= report[key] <= 1.0
    config = json.loads((out / "config.json").read_text())
    head = "ForSequenceClassification" if objective == "reward_model" else "ForCausalLM"
    assert config["architectures"][0].endswith(head)
    if objective == "reward_model":  # loads as a reward, with one label
        from tokenmill.rewards.model import ModelReward

        assert ModelReward(str(out)).model.config.num_labels == 1


def test_preference_pairs_need_their_columns(tiny_model_path, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    assert main(["preference", "--model.path", tiny_model_path, "--data.path", str(data)]) == 2
    assert "data.path: the pairs need columns ['rejected']" in capsys.readouterr().err
