"""mkdocs hooks: the configuration reference built from the schema at every build (the committed
docs/reference/config.md is for readers of the repository; a test keeps it equal), every page under docs/
that mkdocs.yml does not name listed under "More" (a new page is never unreachable), and the repository's
CONTRIBUTING.md published as the site's contributing.md (one text, links rewritten for the site).
Nothing here writes into docs/."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_reference  # a sibling file, not a package


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
    if config["nav"] is not None:
        extra = unlisted_pages(Path(config["docs_dir"]), config["nav"])
        if extra:
            config["nav"].append({"More": extra})
    return config


REPO = Path(__file__).resolve().parents[2]


def contributing_page() -> str:
    """CONTRIBUTING.md with its links into docs/ made relative to the site (`docs/x.md` -> `x.md`)."""
    return re.sub(r"\]\(docs/", "](", (REPO / "CONTRIBUTING.md").read_text())


def on_files(files, config):
    committed = files.get_file_from_path("reference/config.md")
    if committed is not None:
        files.remove(committed)
    files.append(File.generated(config, "reference/config.md", content=config_reference.generate()))
    files.append(File.generated(config, "contributing.md", content=contributing_page()))
    return files
