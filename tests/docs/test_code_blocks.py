"""Every Python and YAML block in docs/ says whether it runs, and the ones that run are run here.

The line before a ```python or ```yaml fence is an HTML comment (invisible on the site):

- `<!-- run -->`: a Python block is run as a script in a fresh folder (exit status 0 within the timeout);
  a YAML block is validated with `tokenmill.config.load_config` (a fragment is completed with a placeholder
  `model` and the built-in `addition` task, so a block may show only the section it is about);
- `<!-- tested: tests/path/to/test_file.py -->`: that test runs the block (it must exist and read the page);
- `<!-- not run: why -->`: an illustration with placeholders (your model, your data), said so on purpose.

A block with none of these fails `test_every_block_says_whether_it_runs`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CHECKED = ("python", "yaml")
MARK = re.compile(r"^<!--\s*(run|tested:\s*(?P<test>\S+)|not run:\s*\S.*?)\s*-->$")
PYTHON_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str | None  # the comment's text: "run", "tested: ...", "not run: ..."

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Fenced blocks of `page` (indented ones in lists too), with the comment line just above each."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+)\s*([\w-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        above = lines[i - 1].strip() if i > 0 else ""
        mark = MARK.match(above)
        found.append(Block(page, i + 1, lang.lower(), code + "\n", mark.group(1) if mark else None))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    pages = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
    return [b for page in pages for b in blocks(page) if b.lang in CHECKED]


BLOCKS = all_blocks()


def test_the_reader_finds_blocks_and_their_marks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n<!-- run -->\n```python\nx = 1\n```\n\n- item\n\n    <!-- not run: mine -->\n"
                    "    ```yaml\n    a: 1\n    ```\n```bash\nls\n```\n")
    got = [(b.line, b.lang, b.code, b.mark) for b in blocks(page)]
    assert got == [(3, "python", "x = 1\n", "run"), (10, "yaml", "a: 1\n", "not run: mine"), (13, "bash", "ls\n", None)]


def test_every_block_says_whether_it_runs():
    unmarked = [str(b) for b in BLOCKS if b.mark is None]
    assert not unmarked, (
        "mark each ```python / ```yaml block with <!-- run -->, <!-- tested: tests/... --> or "
        "<!-- not run: why --> on the line above:\n" + "\n".join(unmarked)
    )


RUN_PYTHON = [b for b in BLOCKS if b.mark == "run" and b.lang == "python"]
RUN_YAML = [b for b in BLOCKS if b.mark == "run" and b.lang == "yaml"]
TESTED = [b for b in BLOCKS if b.mark and b.mark.startswith("tested:")]


@pytest.mark.parametrize("block", RUN_PYTHON, ids=str)
def test_python_block_runs(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=PYTHON_TIMEOUT_S, env=env)
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stderr[-3000:]}"


def complete(tree: dict) -> dict:
    """A config fragment made whole: the sections a page leaves out get placeholders."""
    from tokenmill.config.modes import infer_mode

    tree = dict(tree)
    tree.setdefault("model", {"path": "placeholder/model"})
    mode, _ = infer_mode(tree)
    tree.setdefault("data", {"task": "addition"} if mode in ("rl", "preference", "reward_model")
                    else {"path": "placeholder.jsonl"})
    return tree


@pytest.mark.parametrize("block", RUN_YAML, ids=str)
def test_yaml_block_is_a_valid_config(block):
    from tokenmill.config.load import load_config
    from tokenmill.config.modes import infer_mode, mode

    tree = yaml.safe_load(block.code)
    assert isinstance(tree, dict), f"{block}: a config block is a mapping of sections"
    tree = complete(tree)
    load_config(mode(infer_mode(tree)[0]).schema, tree)  # raises ConfigError naming the bad field


def test_a_fragment_is_completed_and_a_bad_field_is_refused():
    from tokenmill.config.load import load_config
    from tokenmill.config.schema import RLConfig
    from tokenmill.types import ConfigError

    assert complete({"algorithm": {"kl_coef": 0.1}})["data"] == {"task": "addition"}
    with pytest.raises(ConfigError, match="algorithm.kl_coeff"):
        load_config(RLConfig, complete({"algorithm": {"kl_coeff": 0.1}}))


@pytest.mark.parametrize("block", TESTED, ids=str)
def test_tested_block_names_a_test_that_reads_its_page(block):
    test = REPO / block.mark.split(":", 1)[1].strip()
    assert test.is_file(), f"{block}: {test.relative_to(REPO)} does not exist"
    assert block.page.relative_to(REPO).as_posix() in test.read_text() or block.page.name in test.read_text(), (
        f"{block}: {test.relative_to(REPO)} does not read {block.page.name}"
    )
