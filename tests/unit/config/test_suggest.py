"""A misspelt key is answered with the names meant, the same in the CLI, YAML, the Python API and the Composer
(all validate through `config.load`); a bare `--resume` points at `--checkpoint.resume true`; `--help` of a
config command lists its keys and where the field reference is."""

from __future__ import annotations

import pytest
import yaml

import tokenmill
from tokenmill.cli import main
from tokenmill.composer.configs import import_yaml, validate
from tokenmill.config import RLConfig, SFTConfig
from tokenmill.config.rewards import RewardModelConfig
from tokenmill.config.suggest import fields_at, flag_hints, unknown_key_message
from tokenmill.types import ConfigError

BASE = {"model": {"path": "org/model"}, "data": {"task": "addition"}}


def cli_error(argv: list[str], capsys) -> list[str]:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[1:]


def test_the_cli_names_the_field_meant(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli_error(["validate", str(path), "--generation.group_sise", "4"], capsys) == [
        "generation.group_sise: unknown field; did you mean group_size?"]
    assert cli_error(["validate", str(path), "--generaton.group_size", "4"], capsys) == [
        "generaton: unknown section; did you mean generation?"]
    assert cli_error(["validate", str(path), "--training.lr", "1e-5", "--resume", "true"], capsys) == [
        "training.lr: unknown field; did you mean learning_rate?",  # initials
        "resume: unknown field; did you mean checkpoint.resume?"]  # the same name in another section


def test_a_yaml_typo_at_any_depth(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": {"path": "org/model", "lora": {"rnak": 4}},
                                    "rewards": [{"function": "r.py:f", "wieght": 2.0}], "chekpoint": {"every": 2}}))
    assert sorted(cli_error(["validate", str(path)], capsys)) == [
        "chekpoint: unknown section; did you mean checkpoint?",
        "model.lora.rnak: unknown field; did you mean rank?",
        "rewards.0.wieght: unknown field; did you mean weight?"]


def test_no_close_name_lists_what_the_section_takes():
    assert unknown_key_message(RLConfig, ("generation", "zzz"), 1) == (
        "unknown field; this section takes group_size, max_tokens, temperature, top_p, top_k, stop")
    assert unknown_key_message(RLConfig, ("zzz",), 1).startswith("unknown field; a config takes model, data, env")
    assert fields_at(RLConfig, ("rewards", 0, "model")) == list(RewardModelConfig.model_fields)  # a union's tag
    assert fields_at(RLConfig, ("nope",)) == []


@pytest.mark.parametrize("call", [
    lambda: tokenmill.train({**BASE, "generation": {"group_sise": 4}}),
    lambda: tokenmill.train(BASE, generation__group_sise=4),
    lambda: tokenmill.sft({"model": {"path": "m"}, "data": {"path": "d.jsonl", "sise": 1}, "generation": {}}),
    lambda: tokenmill.preference({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "bta": 0.1}),
])
def test_the_python_api_says_the_same(call):
    with pytest.raises(ConfigError) as err:
        call()
    assert "unknown" in str(err.value) and "Extra inputs" not in str(err.value)
    assert all(": unknown " in line for line in str(err.value).splitlines())


def test_the_python_api_names_the_field_meant():
    with pytest.raises(ConfigError, match=r"^generation\.group_sise: unknown field; did you mean group_size\?$"):
        tokenmill.train({**BASE, "generation": {"group_sise": 4}})
    with pytest.raises(ConfigError, match=r"^bta: unknown field; did you mean beta or betas\?$"):
        tokenmill.preference({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "bta": 0.1})


def test_the_composer_says_the_same():
    cfg, errors = validate("rl", {**BASE, "generation": {"group_sise": 4}})
    assert cfg is None and errors == [{"path": "generation.group_sise",
                                       "message": "unknown field; did you mean group_size?"}]
    out = import_yaml("model: {path: m}\ndata: {task: addition}\ncontroler: {steps: 3}\n")
    assert out["errors"] == [{"path": "controler",
                              "message": "unknown key, left out of the imported config; did you mean controller?"}]


def test_a_bare_flag_points_at_its_field(capsys):
    assert cli_error(["train", "--resume"], capsys) == [
        "override --resume has no value; did you mean --checkpoint.resume true?"]
    # the next override is not its value
    assert cli_error(["validate", "--resume", "--model.path", "m"], capsys) == [
        "override --resume has no value; did you mean --checkpoint.resume true?"]
    assert cli_error(["validate", "--algorithm.clip_low"], capsys) == [
        "override --algorithm.clip_low has no value: --algorithm.clip_low VALUE or --algorithm.clip_low=VALUE"]
    assert flag_hints(SFTConfig, "learning_rate") == ["--learning_rate VALUE"]


@pytest.mark.parametrize("command, keys", [("train", "model, data, env, generation"),
                                           ("sft", "model, output_dir, steps"),
                                           ("preference", "objective, beta")])
def test_help_lists_the_config_keys_and_the_reference(command, keys, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"config keys: {keys}" in out or keys in out.split("config keys: ")[1]
    assert "docs/reference/config.md" in out
