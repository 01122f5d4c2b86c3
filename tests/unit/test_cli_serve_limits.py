"""Every server command takes the connection limits' flags (`--read-timeout-s`, `--max-connections`) and
refuses values that cannot work with one line naming the flag."""

from __future__ import annotations

import pytest

from tokenmill import cli
from tokenmill.serving_limits import ConnectionLimits

COMMANDS = [["serve", "model"], ["env", "serve", "guess_number"], ["serve-trainer", "model"], ["composer"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_server_command_takes_the_limits(command):
    args = cli.build_parser().parse_args([*command, "--read-timeout-s", "2.5", "--max-connections", "40"])
    assert cli._limits(args) == ConnectionLimits(read_timeout_s=2.5, max_connections=40)
    defaults = cli._limits(cli.build_parser().parse_args(command))
    assert defaults == ConnectionLimits() and defaults.read_timeout_s == 30.0 and defaults.max_connections is None


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--read-timeout-s", "0", "argument --read-timeout-s: must be > 0, got 0"),
    ("--max-connections", "-3", "argument --max-connections: must be > 0, got -3"),
    ("--max-connections", "many", "argument --max-connections: expected an integer, got 'many'"),
])
def test_a_bad_limit_is_one_line_naming_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["env", "serve", "guess_number", flag, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
