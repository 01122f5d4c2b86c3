"""Did-you-mean for config keys: the fields a section takes, the closest to a misspelt one, and where a field
of that name lives (`--resume` is `--checkpoint.resume`). Walks the pydantic schema, never a config."""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterator
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Tag

MAX_SHOWN = 12  # field names listed when none is close to the misspelt one


def _members(tp: Any, tag: str | None = None) -> list[tuple[Any, str | None]]:
    """The types a field's annotation can hold, Optional and unions unwrapped, each with its union `Tag`."""
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *meta = get_args(tp)
        tag = next((m.tag for m in meta if isinstance(m, Tag)), tag)
        return _members(inner, tag)
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg, tag)]
    return [(tp, tag)]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _step(candidates: list[tuple[Any, str | None]], part: str | int) -> list[tuple[Any, str | None]]:
    """The types one step down a pydantic error location: a field, a list item, a dict value, or the union
    member pydantic names by its tag or class name."""
    picked = [(t, None) for t, tag in candidates if part in (tag, getattr(t, "__name__", None))]
    if picked:
        return picked
    out: list[tuple[Any, str | None]] = []
    for tp, _ in candidates:
        origin, args = get_origin(tp), get_args(tp)
        if _is_model(tp) and isinstance(part, str) and part in tp.model_fields:
            out += _members(tp.model_fields[part].annotation)
        elif isinstance(part, int) and origin in (list, tuple, set, frozenset) and args:
            out += _members(args[0])
        elif origin is dict and len(args) == 2:
            out += _members(args[1])
    return out


def fields_at(schema: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The field names of the section at pydantic location `loc` (every union member's), in schema order."""
    candidates = _members(schema)
    for part in loc:
        candidates = _step(candidates, part)
    names = [name for tp, _ in candidates if _is_model(tp) for name in tp.model_fields]
    return list(dict.fromkeys(names))


def field_paths(schema: type[BaseModel], prefix: str = "", depth: int = 4) -> Iterator[tuple[str, Any]]:
    """(dotted path, annotation) of every field reachable through sections (not through lists)."""
    for name, info in schema.model_fields.items():
        path = f"{prefix}{name}"
        yield path, info.annotation
        if depth > 1:
            for tp, _ in _members(info.annotation):
                if _is_model(tp):
                    yield from field_paths(tp, f"{path}.", depth - 1)


def paths_named(schema: type[BaseModel], name: str) -> list[str]:
    """Dotted paths of the fields called `name` anywhere in the schema's sections (`resume` ->
    `checkpoint.resume`)."""
    return list(dict.fromkeys(p for p, _ in field_paths(schema) if p.rpartition(".")[2] == name))


def flag_hints(schema: type[BaseModel], name: str) -> list[str]:
    """The overrides that set a field called `name`: `--checkpoint.resume true` (a boolean) or `--a.b VALUE`."""
    return [f"--{path} {'true' if bool in [t for t, _ in _members(tp)] else 'VALUE'}"
            for path, tp in field_paths(schema) if path.rpartition(".")[2] == name]


def unknown_key_message(schema: type[BaseModel] | None, loc: tuple[str | int, ...], value: Any = None) -> str:
    """Why the key at `loc` is refused, with the closest names the section takes (initials, else difflib) or,
    when none is close, a field of that name elsewhere or the names it takes: `unknown field; did you mean group_size?`."""
    word = "section" if len(loc) == 1 and isinstance(value, dict) else "field"
    if schema is None or not loc:
        return f"unknown {word}"
    key = str(loc[-1])
    names = fields_at(schema, loc[:-1])
    close = [n for n in names if "_" in n and "".join(w[:1] for w in n.split("_")) == key]  # lr: learning_rate
    close = close or difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    if close:
        return f"unknown {word}; did you mean {' or '.join(close)}?"
    elsewhere = [p for p in paths_named(schema, key) if p.split(".")[:-1] != [str(x) for x in loc[:-1]]]
    if elsewhere:
        return f"unknown {word}; did you mean {' or '.join(elsewhere[:3])}?"
    if not names:
        return f"unknown {word}"
    shown = ", ".join(names[:MAX_SHOWN]) + (", ..." if len(names) > MAX_SHOWN else "")
    return f"unknown {word}; {'this section' if len(loc) > 1 else 'a config'} takes {shown}"
