"""docs/client.md's GRPO-in-40-lines block, run as written: a short run on a tiny model here (it samples,
trains and prints the held-out accuracy), and in the slow tests the full loop on the quickstart's warm model,
in-process and against `tokenmill serve-trainer`, where held-out accuracy must rise by at least 10 points."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.serving import read_port

PAGE = Path(__file__).resolve().parents[3] / "docs" / "client.md"
MARK = "<!-- tested: tests/unit/client/test_client_example.py -->"


def example() -> str:
    text = PAGE.read_text()
    block = text.split(MARK, 1)[1].split("```python\n", 1)[1]
    return block.split("\n```", 1)[0]


def run_example(tmp_path: Path, timeout: float, **env: str) -> tuple[float, float]:
    script = tmp_path / "grpo_client.py"
    script.write_text(example())
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"held-out accuracy ([\d.]+) -> ([\d.]+)", done.stdout)
    assert found, done.stdout
    return float(found[1]), float(found[2])


def test_the_example_runs_in_process(tmp_path):
    from tokenmill.recipes.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    before, after = run_example(tmp_path, 300, MODEL=str(model), STEPS="2")
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    from tokenmill.recipes import warm_start

    return warm_start(tmp_path_factory.mktemp("quickstart"), num_eval=200, say=lambda _: None)


@pytest.mark.slow
def test_the_example_learns_in_process(tmp_path, warm):
    before, after = run_example(tmp_path, 900, MODEL=str(warm))
    print(f"in process: held-out accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.10, (before, after)


@pytest.mark.slow
def test_the_example_learns_over_http(tmp_path, warm):
    server = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve-trainer", str(warm), "--port", "0",
                               "--root", str(tmp_path / "root")], stdout=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stdout:
            port = read_port(line)
            if port:
                break
        assert port, "serve-trainer printed no ready line"
        before, after = run_example(tmp_path, 900, TRAINER_URL=f"http://127.0.0.1:{port}")
        print(f"over HTTP: held-out accuracy {before:.3f} -> {after:.3f}")
        assert after - before >= 0.10, (before, after)
    finally:
        server.terminate()
        server.wait(30)
