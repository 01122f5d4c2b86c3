"""Write docs/reference/config.md from the pydantic schema, so the reference cannot drift from the code.

Run as a script (`python docs/hooks/config_reference.py`, or `--check` to fail when the committed page is
stale); `mkdocs build` serves the generated text (`docs/hooks/site.py`), and a test keeps the committed page
equal to it. Every field of every run mode's config is
listed with its YAML key, type, default, allowed range and description, section by section.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DOCS = Path(__file__).resolve().parents[1]
PAGE = DOCS / "reference" / "config.md"
HEADER = """# Configuration reference

<!-- Generated from tokenmill.config by docs/hooks/config_reference.py: edit the schema, not this page. -->

Every YAML key tokenmill reads, generated from the schema the loader validates against. Unknown keys are
refused, and every field can be overridden on the command line with a dotted flag
(`--algorithm.kl_coef 0.01`). `required` marks a field without a default.
"""
BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The config sections an annotation holds (`X`, `X | None`, `list[X | Y]`, `Annotated[...]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(m for m in _models_in(arg) if m not in found)
    return found


def type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(dict.fromkeys(type_name(a) for a in args))  # one "section" for a tagged union
    if origin in (list, tuple, set):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`"


def bounds_text(field: FieldInfo) -> str:
    parts = []
    for constraint in field.metadata:
        for attr, sign in BOUNDS.items():
            value = getattr(constraint, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def section(model: type[BaseModel], key: str, level: int, seen: set[str]) -> list[str]:
    """A heading and a table for `model` at YAML path `key`, then its own sections below it."""
    lines = [f"{'#' * level} `{key}`", ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith("Usage docs") and model.__doc__ is not BaseModel.__doc__:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        yaml_key = field.alias or name
        if name == "type" and typing.get_origin(field.annotation) is typing.Literal:
            yaml_key = "type"
        lines.append(
            f"| `{yaml_key}` | {type_name(field.annotation)} | {default_text(field)} | {bounds_text(field)} "
            f"| {_cell(field.description or '')} |"
        )
        for sub in _models_in(field.annotation):
            is_list = typing.get_origin(field.annotation) is list
            sub_key = f"{key}.{yaml_key}[]" if is_list else f"{key}.{yaml_key}"
            if is_list and len(_models_in(field.annotation)) > 1:
                tag = sub.model_fields.get("type")
                sub_key += f" (type: {tag.default})" if tag is not None else f" ({sub.__name__})"
            nested.append((sub_key, sub))
    lines.append("")
    for sub_key, sub in nested:
        if sub_key not in seen:
            seen.add(sub_key)
            lines += section(sub, sub_key, min(level + 1, 4), seen)
    return lines


def top_level(model: type[BaseModel], title: str, commands: str) -> list[str]:
    doc = " ".join((model.__doc__ or "").split())
    lines = [f"## {title}", "", f"Read by {commands}. {doc}".strip(), ""]
    lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        subs = _models_in(field.annotation)
        described = field.description or ("see below" if subs else "")
        lines.append(
            f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} | {bounds_text(field)} "
            f"| {_cell(described)} |"
        )
        for sub in subs:
            is_list = typing.get_origin(field.annotation) is list
            sub_key = f"{key}[]" if is_list else key
            if is_list and len(subs) > 1:
                tag = sub.model_fields.get("type")
                sub_key += f" (type: {tag.default})" if tag is not None else f" ({sub.__name__})"
            nested.append((sub_key, sub))
    lines.append("")
    seen: set[str] = set()
    for key, sub in nested:
        lines += section(sub, key, 3, seen)
    return lines


def generate() -> str:
    from tokenmill.config.modes import MODES

    by_schema: dict[type[BaseModel], list[str]] = {}
    titles: dict[type[BaseModel], str] = {}
    for mode in MODES.values():
        by_schema.setdefault(mode.schema, [])
        command = f"`tokenmill {mode.command}`"
        if command not in by_schema[mode.schema]:
            by_schema[mode.schema].append(command)
        titles.setdefault(mode.schema, f"{mode.title}: `{mode.schema.__name__}`")
    lines = [HEADER]
    for schema, commands in by_schema.items():
        lines += top_level(schema, titles[schema], " and ".join(commands))
    return "\n".join(lines).rstrip() + "\n"


def write(page: Path = PAGE) -> bool:
    """Write the page if its text changed; return whether it did."""
    text = generate()
    if page.is_file() and page.read_text() == text:
        return False
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return True


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        if not PAGE.is_file() or PAGE.read_text() != generate():
            sys.exit(f"{PAGE} is stale: run `python docs/hooks/config_reference.py`")
        print(f"{PAGE} is up to date")
    else:
        print(f"{PAGE} {'written' if write() else 'unchanged'}")
