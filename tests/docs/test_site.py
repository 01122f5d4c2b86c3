"""The docs site: the configuration reference equals what the schema generates, the navigation reaches every
page, CONTRIBUTING.md is published with working links, and the whole site builds with `mkdocs --strict`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "docs" / "hooks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HOOKS))  # site.py imports its sibling
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(HOOKS))
    return module


def test_the_committed_config_reference_is_what_the_schema_generates():
    ref = load("config_reference")
    assert ref.PAGE.read_text() == ref.generate(), "run `python docs/hooks/config_reference.py` and commit the page"


def test_the_config_reference_rows_read_the_schema():
    text = load("config_reference").generate()
    # by hand from AlgorithmConfig.clip_low = Field(0.2, ge=0.0, le=1.0, description=...)
    assert "| `clip_low` | float | `0.2` | ≥ 0.0, ≤ 1.0 | PPO clip range below 1 (ratio >= 1 - clip_low). |" in text
    # a required field, a literal, an alias (EngineConfig.weight_sync is `sync` in YAML) and a tagged union
    assert "| `path` | str | required | length ≥ 1 | Hugging Face model folder (or hub id) of the policy. |" in text
    assert "| `dtype` | 'auto' \\| 'float32' \\| 'bfloat16' \\| 'float16' | `'auto'` |" in text
    engine = text.split("### `engine`\n", 1)[1].split("\n### ", 1)[0]  # (cluster.weight_sync is a field of its own)
    assert "| `sync` |" in engine and "| `weight_sync` |" not in engine
    assert "### `rewards[] (type: function)`" in text and "### `rewards[] (type: model)`" in text
    for heading in ("## Online RL (GRPO / PPO): `RLConfig`", "`SFTConfig`", "`PreferenceConfig`"):
        assert heading in text


def test_pages_missing_from_the_nav_are_listed_under_more(tmp_path):
    site = load("site")
    for page in ("index.md", "b.md", "sub/c.md", "hooks/notes.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# x\n")
    nav = [{"Home": "index.md"}, {"Group": [{"B": "b.md"}]}]
    assert site.unlisted_pages(tmp_path, nav) == ["sub/c.md"]


def test_contributing_is_published_with_links_that_work_on_the_site():
    page = load("site").contributing_page()
    assert "](docs/" not in page
    assert "](reference/config.md)" in page and "](benchmarks.md#how-comparisons-are-run)" in page


def test_the_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs") is None and not os.environ.get("TOKENMILL_CI"):
        pytest.skip("needs mkdocs (the dev extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=180, check=False, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    built = tmp_path / "site"
    assert (built / "reference" / "config" / "index.html").is_file()
    assert "How the code is shaped" in (built / "contributing" / "index.html").read_text()
