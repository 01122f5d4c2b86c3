"""`tokenmill vllm`: builds (or reuses) the cached venv, refuses a non-loopback bind without --allow-remote."""

from __future__ import annotations

import subprocess
import sys


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "vllm", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_install_only_prints_the_cached_venvs_python(vllm_python):
    done = _cli("--install-only", "--venv", str(vllm_python.parent.parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(vllm_python)


def test_a_public_bind_needs_allow_remote(tmp_path):
    done = _cli(str(tmp_path), "--host", "0.0.0.0", "--venv", str(tmp_path / "never-built"))
    assert done.returncode == 1
    assert "--host 0.0.0.0" in done.stderr and "--allow-remote" in done.stderr
    assert not (tmp_path / "never-built").exists()  # refused before anything was installed


def test_serving_needs_a_model_folder(vllm_python):
    done = _cli("--venv", str(vllm_python.parent.parent))
    assert done.returncode == 1 and "name the model folder" in done.stderr
