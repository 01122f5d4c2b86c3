"""The committed Composer bundle (`composer/static/`) is exactly what `npm run build` makes from the sources.

`pip install` ships the committed files and never runs node, so a source edit without a rebuild would
ship a stale page. Skipped where node or the front end's node_modules are missing, except in CI
(`TOKENMILL_CI=1`, set by .ci/run after `npm ci`), where a missing tool fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSER = Path(__file__).resolve().parents[2] / "src" / "tokenmill" / "composer"
FRONTEND = COMPOSER / "frontend"
STATIC = COMPOSER / "static"


@pytest.mark.skipif(
    not os.environ.get("TOKENMILL_CI")
    and (shutil.which("node") is None or not (FRONTEND / "node_modules" / "esbuild").is_dir()),
    reason="needs node and `npm ci` in src/tokenmill/composer/frontend",
)
def test_committed_bundle_equals_a_fresh_build(tmp_path):
    subprocess.run(["node", "build.mjs", "--outdir", str(tmp_path)], cwd=FRONTEND, check=True, timeout=120,
                   capture_output=True)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == ["app.css", "app.js", "index.html"]
    stale = [name for name in built if (tmp_path / name).read_bytes() != (STATIC / name).read_bytes()]
    assert not stale, f"composer/static/{stale} differ from a fresh build: run `npm run build` in {FRONTEND}"


def test_bundle_is_self_contained():
    """No CDN: the page loads only its own files, and the bundle carries the libraries it needs."""
    html = (STATIC / "index.html").read_text()
    assert 'src="/static/app.js"' in html and 'href="/static/app.css"' in html
    assert "http://" not in html and "https://" not in html
    js = (STATIC / "app.js").read_text()
    for marker in ("launch-run", "preview-table", "chart-reward", "models-diagram"):
        assert marker in js, marker
