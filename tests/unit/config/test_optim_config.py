"""The optimiser is declared once (`OptimConfig`) and shared by every mode: RL's `training:` section and the
SFT / preference configs' top level. Each mode keeps its own defaults and every field path it had."""

from __future__ import annotations

import inspect

import pytest

from tokenmill.config import OptimConfig, PreferenceConfig, RLConfig, SFTConfig, TrainingConfig, load_config
from tokenmill.types import ConfigError

MODES = (TrainingConfig, SFTConfig, PreferenceConfig)
BASE = {"model": {"path": "org/model"}, "data": {"task": "addition"}}


@pytest.mark.parametrize("mode", MODES)
def test_the_optimiser_fields_are_declared_once(mode):
    assert issubclass(mode, OptimConfig)
    own = inspect.get_annotations(mode)
    for name, declared in OptimConfig.model_fields.items():
        assert name not in own, f"{mode.__name__} re-declares {name}"
        field = mode.model_fields[name]
        assert (field.annotation, field.metadata, field.description) == (
            declared.annotation, declared.metadata, declared.description), name


def test_each_mode_keeps_its_defaults_and_none_leaks_into_another():
    defaults = {mode: {n: mode.model_fields[n].default for n in ("learning_rate", "warmup_steps", "lr_schedule")}
                for mode in (OptimConfig, *MODES)}
    assert defaults == {
        OptimConfig: {"learning_rate": 1e-5, "warmup_steps": 0, "lr_schedule": "constant"},
        TrainingConfig: {"learning_rate": 1e-5, "warmup_steps": 0, "lr_schedule": "constant"},
        SFTConfig: {"learning_rate": 1e-3, "warmup_steps": 20, "lr_schedule": "cosine"},
        PreferenceConfig: {"learning_rate": 2e-5, "warmup_steps": 10, "lr_schedule": "cosine"},
    }
    sft, pref = load_config(SFTConfig, BASE), load_config(PreferenceConfig, BASE)
    assert (sft.steps, sft.batch_size, sft.output_dir) == (300, 64, "runs/sft")
    assert (pref.steps, pref.batch_size, pref.output_dir) == (200, 32, "runs/preference")


def test_the_old_field_paths_still_validate():
    given = {"learning_rate": 3e-4, "warmup_steps": 7, "seed": 5, "steps": 9, "batch_size": 3}
    for mode in (SFTConfig, PreferenceConfig):
        cfg = load_config(mode, {**BASE, **given})
        assert {k: getattr(cfg, k) for k in given} == given
        over = load_config(mode, BASE, {"learning_rate": 0.5, "seed": 2})  # `--learning_rate 0.5 --seed 2`
        assert (over.learning_rate, over.seed) == (0.5, 2)
    rl = load_config(RLConfig, {**BASE, "training": {"learning_rate": 3e-4, "warmup_steps": 7}},
                     {"training.seed": 5, "training.lr_schedule": "cosine"})
    assert (rl.training.learning_rate, rl.training.warmup_steps, rl.training.seed, rl.training.lr_schedule) == (
        3e-4, 7, 5, "cosine")


def test_every_mode_now_takes_every_optimiser_field_with_its_bounds():
    cfg = load_config(SFTConfig, {**BASE, "weight_decay": 0.1, "betas": [0.8, 0.9], "lr_schedule": "linear",
                                  "max_grad_norm": 0.5})
    assert cfg.optimiser() == {"learning_rate": 1e-3, "weight_decay": 0.1, "betas": (0.8, 0.9), "warmup_steps": 20,
                               "lr_schedule": "linear", "max_grad_norm": 0.5, "seed": 0}
    with pytest.raises(ConfigError, match=r"^learning_rate: Input should be less than or equal to 1 \(got 2\)"):
        load_config(PreferenceConfig, {**BASE, "learning_rate": 2})
    with pytest.raises(ConfigError, match=r"^training.warmup_steps: Input should be greater than or equal to 0"):
        load_config(RLConfig, {**BASE, "training": {"warmup_steps": -1}})
