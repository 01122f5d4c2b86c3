"""mkdocs hooks: regenerate the configuration reference before each build, and list in the navigation any
page under docs/ that mkdocs.yml does not name yet (under "More"), so a new page is never unreachable."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_reference  # noqa: E402  (a sibling file, not a package)


def _named(nav: object) -> set[str]:
    """Every page path that a nav tree (lists of {title: path-or-subtree}) names."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_named(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_named(v) for v in nav.values())) if nav else set()
    return set()


def unlisted_pages(docs_dir: Path, nav: object) -> list[str]:
    named = _named(nav)
    pages = (p.relative_to(docs_dir).as_posix() for p in sorted(docs_dir.rglob("*.md")))
    return [p for p in pages if p not in named and not p.startswith("hooks/")]


def on_config(config):
    config_reference.write()
    if config["nav"] is not None:
        extra = unlisted_pages(Path(config["docs_dir"]), config["nav"])
        if extra:
            config["nav"].append({"More": extra})
    return config
