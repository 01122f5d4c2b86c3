"""The YAML block a docs page marks as tested by a given test (`<!-- tested: tests/... -->` before its fence)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DOCS = Path(__file__).resolve().parents[3] / "docs"


def docs_block(page: str, test: str) -> dict[str, Any]:
    """The first ```yaml block of `docs/<page>` whose marker names `test` (a path from the repository root)."""
    text = (DOCS / page).read_text()
    block = text.split(f"<!-- tested: {test} -->\n```yaml\n", 1)[1]
    return yaml.safe_load(block.split("```", 1)[0])
