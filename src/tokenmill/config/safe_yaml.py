"""A YAML reader for config files that a hostile or careless file cannot turn into a memory bomb.

PyYAML's safe loader shares one object per anchor, so a 300-byte file of nested aliases ("billion laughs")
loads in microseconds but expands to billions of values as soon as anything walks it (validation, an error
message, a JSON answer). This reader bounds the file size, the number of aliases, the expanded size and the
nesting depth, refuses duplicate keys (PyYAML keeps the last one silently, so a repeated section replaces
the first), and returns a tree with no shared parts.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml

from tokenmill.types import ConfigError

MAX_FILE_BYTES = 1 << 20  # a config is a few kB; 1 MiB leaves room for long stop lists or inline task kwargs
MAX_ALIASES = 64  # anchors are fine for sharing a block or two; a bomb needs many aliases
MAX_VALUES = 100_000  # scalars, lists and mappings after aliases are expanded
MAX_DEPTH = 64  # nesting levels
MAX_TEXT = 2 * MAX_FILE_BYTES  # characters of all strings after expansion (a 1 MB string aliased 64 times is not)

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_SHORT.maxlevel = 3


def shorten(value: Any) -> str:
    """repr() of `value` cut to about 40 characters (and four items per level), at a cost bounded by the cut,
    so that no error message echoes a 10 MB value or walks an alias bomb."""
    return _SHORT.repr(value)


def _key_text(node: yaml.Node) -> str:
    return shorten(node.value) if isinstance(node, yaml.ScalarNode) else f"a {node.id} key"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases and refuses duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise ConfigError(f"line {mark.line + 1}: more than {MAX_ALIASES} YAML aliases (*name); "
                                  "write the values out instead")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key (a list): the base class reports it
                continue
            seen[key] = line
            if first is not None:
                raise ConfigError(f"line {line}: key {_key_text(key_node)} appears twice (first on line {first}); "
                                  "YAML would silently keep only the last one")
        return super().construct_mapping(node, deep=deep)


def _check_size(tree: Any) -> None:
    """Walk the loaded tree as if aliases were expanded, stopping at the first bound it crosses."""
    count = chars = 0
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if isinstance(node, str):
            chars += len(node)
        if count > MAX_VALUES:
            raise ConfigError(f"more than {MAX_VALUES:,} values once aliases are expanded")
        if chars > MAX_TEXT:
            raise ConfigError(f"more than {MAX_TEXT:,} characters of text once aliases are expanded")
        if depth > MAX_DEPTH:
            raise ConfigError(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            chars += sum(len(k) for k in node if isinstance(k, str))
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _unshared(node: Any) -> Any:
    """A copy in which every alias is its own object (copy.deepcopy would keep the sharing)."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshared(v) for v in node]
    return node  # scalars are immutable


def load_yaml_text(text: str) -> Any:
    """Parse one YAML document within the bounds above; `ConfigError` (without the file name) otherwise.
    The result shares no objects, so editing one part never changes another."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"{len(text):,} characters; a config is at most {MAX_FILE_BYTES:,}")
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader checks the characters here already
        tree = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"nested more than {MAX_DEPTH} levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()
    _check_size(tree)
    return _unshared(tree)


def decode_config_bytes(data: bytes) -> str:
    """UTF-8 text of a config file (a BOM is dropped); `ConfigError` naming the first bad byte."""
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{len(data):,} bytes; a config file is at most {MAX_FILE_BYTES:,}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "save the file as UTF-8") from None
