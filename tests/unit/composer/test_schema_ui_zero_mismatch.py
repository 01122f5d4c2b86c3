"""The Composer's RL form shows `training.deterministic` and its `training.zero_mismatch` in the Training
group, with what they do, and a config the form writes with them validates."""

from __future__ import annotations


def test_the_rl_form_has_the_zero_mismatch_switches():
    from tokenmill.composer.schema_ui import schema_fields

    fields = {f["path"]: f for f in schema_fields("rl")}
    deterministic, zero = fields["training.deterministic"], fields["training.zero_mismatch"]
    assert (deterministic["type"], deterministic["default"], deterministic["group"]) == ("boolean", False, "training")
    assert (zero["type"], zero["default"], zero["group"]) == ("boolean", True, "training")
    assert "bit for bit" in deterministic["description"] and "mismatch/max_abs is exactly 0" in zero["description"]


def test_a_config_with_them_validates():
    from tokenmill.config import RLConfig, load_config

    cfg = load_config(RLConfig, {"model": {"path": "m"}, "data": {"task": "addition"},
                                 "training": {"deterministic": True, "zero_mismatch": False}})
    assert cfg.training.deterministic and not cfg.training.zero_mismatch
