"""YAML + dotted overrides -> a validated config, or a `ConfigError` naming each bad field."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenmill.config.modes import MODES, strip_extras
from tokenmill.config.safe_yaml import MAX_FILE_BYTES, decode_config_bytes, load_yaml_text, shorten
from tokenmill.config.suggest import flag_hints, unknown_key_message
from tokenmill.types import ConfigError

C = TypeVar("C", bound=BaseModel)
MAX_PROBLEMS = 20  # lines of one error message (a list of 1,000 bad items is not 1,000 lines)
TAGS = {"function", "model", "builtin", "judge"}


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `["--algorithm.kl_coef", "0.01", "--a.b=2"]` into `{"algorithm.kl_coef": 0.01, "a.b": 2}`.

    Values are parsed as YAML scalars/lists (`0.01`, `true`, `[a, b]`), so types follow the schema.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --section.field VALUE, got {shorten(arg)}")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            if i + 1 >= len(args) or OVERRIDE.match(args[i + 1]):
                raise ConfigError(_no_value(key))
            i += 1
            raw = args[i]
        try:
            out[key] = load_yaml_text(raw)
        except ConfigError:  # not YAML (or an alias bomb): the text itself, which the schema then judges
            out[key] = raw
        i += 1
    return out


OVERRIDE = re.compile(r"^--[A-Za-z_]")  # the next override, not a value (a value may be `-1`)


def _no_value(key: str) -> str:
    """`override --KEY has no value`, pointing a bare flag at the field of that name (`--resume` is
    `--checkpoint.resume true`)."""
    shown = _short_key(key)
    hints = [] if "." in key else list(dict.fromkeys(h for m in MODES.values() for h in flag_hints(m.schema, key)))
    if not hints:
        return f"override --{shown} has no value: --{shown} VALUE or --{shown}=VALUE"
    return f"override --{shown} has no value; did you mean {' or '.join(hints)}?"


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, list) and parts[-1] != part:
            raise ConfigError(f"{_short_key(dotted)}: list fields are set whole, e.g. --{_short_key(part)} '[...]'")
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{_short_key(dotted)}: {_short_key(part)} is not a section")
        node = child
    node[parts[-1]] = value


def _short_path(path: str) -> str:
    return path if len(path) <= 200 else f"{path[:200]}..."


def _short_key(key: str) -> str:
    """A key as shown in a message: itself, or its first 40 characters when it is longer."""
    return key if len(key) <= 40 else f"{key[:40]}..."


FIELD_PREFIX = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)*): ")


def format_validation_error(err: ValidationError, schema: type[BaseModel] | None = None) -> str:
    """One line per problem: `algorithm.clip_low: Input should be less than or equal to 1 (got 3)`; an unknown
    key with the closest names of `schema` (the model validated): `generation.group_sise: unknown field; did
    you mean group_size?`."""
    lines = []
    errors = err.errors()
    for e in errors[:MAX_PROBLEMS]:
        parts = list(e["loc"])
        # drop union tags that pydantic puts in the path (rewards.0.function.weight -> rewards.0.weight)
        parts = [p for i, p in enumerate(parts) if not (i and isinstance(parts[i - 1], int) and p in TAGS)]
        # and a field's own union members (model.lora.target_modules.list[str] -> model.lora.target_modules)
        parts = [p for p in parts if not (isinstance(p, str) and "[" in p)]
        loc = ".".join(_short_key(str(p)) for p in parts)
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {shorten(got)})"
        if e["type"] == "extra_forbidden":  # a typo: the names it may have meant, not the value it was given
            msg, shown = unknown_key_message(schema, tuple(e["loc"]), got), ""
        named = FIELD_PREFIX.match(msg)
        # a cross-field check names the field it blames (`section.field: ...`), in its section or above it
        if named and (not loc or named.group(1).startswith(f"{loc}.")):
            loc, msg = named.group(1), msg[named.end() :]
        lines.append(f"{loc or 'config'}: {msg}{shown}")
    if len(errors) > MAX_PROBLEMS:
        lines.append(f"... and {len(errors) - MAX_PROBLEMS} more problems")
    return "\n".join(lines)


def read_yaml_tree(source: str | Path) -> dict[str, Any]:
    """A config file's top-level mapping; `ConfigError` naming the file when it is missing or not one."""
    path = Path(source)
    shown = _short_path(str(path))
    try:
        exists = path.is_file()
        size = path.stat().st_size if exists else 0
        data = b""
        if exists and size <= MAX_FILE_BYTES:  # a larger file is refused before it is read
            with path.open("rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)  # a special file may say size 0 and be endless
    except OSError as exc:  # a name too long, a file that cannot be read
        raise ConfigError(f"{shown}: cannot read the config file ({exc.strerror or type(exc).__name__})") from None
    if not exists:
        raise ConfigError(f"config file not found: {shown}")
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{shown}: {size:,} bytes; a config file is at most {MAX_FILE_BYTES:,}")
    try:
        tree = load_yaml_text(decode_config_bytes(data)) or {}
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{shown}: the top level must be a mapping of sections")
    return tree


def load_config(
    schema: type[C], source: str | Path | dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> C:
    """Build a `schema` instance from a YAML path or dict plus dotted overrides; raise `ConfigError`.

    A run config may also hold `mode:` and `estimate:` (see `config.modes`): they are checked and dropped."""
    if source is None:
        tree: dict[str, Any] = {}
    elif isinstance(source, dict):
        tree = copy.deepcopy(source)  # overrides edit nested sections: never the caller's dict
    else:
        tree = read_yaml_tree(source)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    if any(m.schema is schema for m in MODES.values()):  # one YAML serves its trainer and `tokenmill estimate`
        tree = strip_extras(tree, schema)
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, schema)) from None
