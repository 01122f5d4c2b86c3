"""Values derived from the config in one place: sequences per step, and the held-out seed offset."""

import pytest

from tokenmill.cli import main
from tokenmill.config import RLConfig, load_config
from tokenmill.types import ConfigError

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}}


def test_sequences_per_step_is_prompts_times_group_size():
    cfg = load_config(RLConfig, BASE, {"controller.prompts_per_step": "3", "generation.group_size": "8"})
    assert cfg.sequences_per_step == 24


def test_the_mini_batch_check_and_validate_use_it(capsys):
    with pytest.raises(ConfigError, match=r"exceeds the sequences per step \(6 = controller.prompts_per_step"):
        load_config(RLConfig, BASE, {"controller.prompts_per_step": "3", "generation.group_size": "2",
                                     "algorithm.mini_batches": "7"})
    assert main(["validate", "--model.path", "m", "--data.task", "addition", "--controller.prompts_per_step", "3",
                 "--generation.group_size", "2"]) == 0
    assert "of 3 prompts x 2 samples = 6 sequences each" in capsys.readouterr().out
