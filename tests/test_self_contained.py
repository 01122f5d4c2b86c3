"""The repository speaks for itself: no text points at files outside it, and none narrates the circumstances
in which it was written. A reader of a clone has only the clone; say what a contributor needs here
(CONTRIBUTING.md, docs/) instead of pointing elsewhere, and state limits as facts ("not yet run on a GPU")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ["src", "tests", "benchmarks", "examples", "docs", ".ci", "README.md", "CONTRIBUTING.md", "mkdocs.yml",
         "pyproject.toml"]
SKIP_SUFFIXES = {".png", ".jpg", ".gif", ".ico", ".woff", ".woff2", ".safetensors", ".bin", ".pt"}

# Written with a character class in the middle so that this file does not match itself. Case matters only for
# the outside notes' names (their upper-case names; docs/reliability.md is the repository's own page).
OUTSIDE = {
    "a path outside the repository": r"\.\./share[d]|/wor[k]/|/home/[a-z]+/|/Users/[A-Za-z]+/",
    "a design note kept outside the repository": r"\b(?:BENCHMARKIN[G]|COMPOSE[R]|RELIABILIT[Y]|STYL[E]|"
    r"DISTRIBUTE[D]|VLL[M]|ARCHITECTURE-REVIE[W])\.md\b",
    "a numbered principle of an outside guide": r"(?i)\bSTYL[E] principle|\bprincipl[e] \d+\b",
}
NARRATION = {
    "how the text was made": r"(?i)\bthis sessio[n]\b|\bthe other engineer[s]\b|\bduring developmen[t]\b|"
    r"\bwhile buildin[g]\b|\bthe lea[d] (?:asked|said|wants)\b",
    "a missing GPU told as a circumstance (say 'not yet run on a GPU')": r"(?i)\bno GP[U] (?:here|this|was available)\b|"
    r"\bNo GP[U] was available\b|\bhad no GP[U]\b",
}


def tracked_text_files() -> list[Path]:
    """Files git tracks or would track (untracked but not ignored) under the repository's own roots."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *ROOTS], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout to know which files belong to the repository")
    files = [REPO / line for line in out.splitlines() if line]
    return [f for f in files if f.is_file() and f.suffix not in SKIP_SUFFIXES and f != Path(__file__).resolve()]


def findings(rules: dict[str, str]) -> list[str]:
    compiled = {why: re.compile(pattern) for why, pattern in rules.items()}
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for why, pattern in compiled.items():
                if match := pattern.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {why}: {match.group(0)!r}")
    return found


def test_the_rules_catch_what_they_describe():
    hits = {
        why: [s for s in samples if re.search(OUTSIDE.get(why) or NARRATION[why], s)]
        for why, samples in {
            "a path outside the repository": ["see ../" + "shared/X", "/" + "work/main/runs"],
            "a design note kept outside the repository": ["as COMPOSER" + ".md says", "(RELIABILITY" + ".md)"],
            "a numbered principle of an outside guide": ["(STYLE" + " principle 2)"],
            "how the text was made": ["this " + "session had", "during " + "development"],
            "a missing GPU told as a circumstance (say 'not yet run on a GPU')": ["no " + "GPU here"],
        }.items()
    }
    assert all(len(v) == len(set(v)) and v for v in hits.values()), hits
    assert not re.search(OUTSIDE["a design note kept outside the repository"], "docs/reliability.md")
    assert not re.search(NARRATION["how the text was made"], "built once per test session")


def test_no_reference_to_files_outside_the_repository():
    found = findings(OUTSIDE)
    assert not found, "carry the content into CONTRIBUTING.md or docs/ instead:\n" + "\n".join(found)


def test_no_narration_of_how_the_repository_was_made():
    found = findings(NARRATION)
    assert not found, "state the fact, not the circumstances:\n" + "\n".join(found)
