"""The Composer's RL form places the options of the 2026 peer features where a user looks for them: the
off-policy correction with its IcePop / binary-KL masks, MoE router replay and step-wise agent samples at the
advanced level in their own sections, proxy mode's step-wise switch with the rest of proxy mode (expert)."""

from __future__ import annotations

from tokenmill.composer.schema_ui import schema_fields, schema_response

ADVANCED = {"algorithm.off_policy": "algorithm", "algorithm.is_cap": "algorithm", "algorithm.mask_low": "algorithm",
            "algorithm.mask_high": "algorithm", "algorithm.mask_kl": "algorithm",
            "training.router_replay": "training", "env.stepwise": "env"}


def test_the_peer_options_are_advanced_fields_of_their_sections():
    fields = {f["path"]: f for f in schema_fields("rl")}
    for path, group in ADVANCED.items():
        assert (fields[path]["level"], fields[path]["group"]) == ("advanced", group), path
        assert fields[path]["description"], path  # the form's help text
    assert fields["training.router_replay"]["enum"] == ["off", "r2", "r3"]
    assert fields["training.router_replay"]["default"] == "off"
    assert {"icepop", "binary_kl", "tis", "decoupled"} <= set(fields["algorithm.off_policy"]["enum"])
    # step-wise samples belong to the env and proxy sections, which the form shows only when set
    assert (fields["env.stepwise"]["optional_section"], fields["env.stepwise"]["default"]) == ("env", False)
    proxy = fields["proxy.stepwise"]
    assert (proxy["level"], proxy["group"], proxy["optional_section"]) == ("expert", "proxy", "proxy")
    assert {f["level"] for f in fields.values() if f["group"] == "proxy"} == {"expert"}


def test_the_preference_and_sft_forms_do_not_carry_them():
    for mode in ("preference", "sft", "reward_model"):
        paths = {f["path"] for f in schema_response(mode)["fields"]}
        assert not paths & {*ADVANCED, "proxy.stepwise"}, mode
