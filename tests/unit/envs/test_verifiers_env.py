"""Loading verifiers environments (`env.verifiers`): the config's rules, and bad input as one line naming the
field and the environment's own error, from the library and from the command line."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.types import ConfigError

ENVS = Path(__file__).parents[2] / "verifiers_envs"


@pytest.fixture(autouse=True)
def envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))


def _cfg(env: dict, data: dict | None = None) -> RLConfig:
    return load_config(RLConfig, {"model": {"path": "m"}, "data": data if data is not None else {"num_eval": 2},
                                  "env": env})


def test_env_takes_exactly_one_source():
    assert _cfg({"verifiers": "tm_vf_sum"}).env.verifiers == "tm_vf_sum"
    with pytest.raises(ConfigError, match=r"^env: set exactly one of env.name, env.url, env.openenv or env.verifiers"):
        _cfg({"verifiers": "tm_vf_sum", "name": "guess_number"})
    with pytest.raises(ConfigError, match=r"^env: set exactly one of env.name, env.url, env.openenv or env.verifiers"):
        _cfg({})


def test_the_taskset_brings_the_rows():
    with pytest.raises(ConfigError, match=r"^data: env.verifiers brings its tasks as the rows"):
        _cfg({"verifiers": "tm_vf_sum"}, {"task": "addition"})
    with pytest.raises(ConfigError, match=r"^data: set exactly one of data.task or data.path"):
        _cfg({"name": "guess_number"}, {})


def test_rows_and_held_out_tasks_come_from_the_taskset():
    from tokenmill.data.build import build_datasets

    cfg = _cfg({"verifiers": "tm_vf_sum", "kwargs": {"taskset": {"num_tasks": 5}}})
    train, held, reward = build_datasets(cfg)
    assert reward is None and len(train) == 3 and len(held) == 2
    assert sorted(r["task"] for r in [*train, *held]) == [0, 1, 2, 3, 4]
    assert {r["prompt"] for r in held} <= {f"{a}+{a + 1}=" for a in range(5)}


@pytest.mark.parametrize("spec, kwargs, message", [
    ("tm_vf_nowhere", {}, ("env.verifiers: cannot load 'tm_vf_nowhere': ModuleNotFoundError: taskset "
                          "'tm_vf_nowhere' not found")),
    ("tm_vf_broken", {}, ("env.verifiers: 'tm_vf_broken' failed while loading its tasks: FileNotFoundError: "
                         "rows.parquet: no such split 'train'")),
    ("tm_vf_sum", {"taskset": {"num_taskz": 3}}, ("env.kwargs: verifiers environment 'tm_vf_sum' failed to load: "
                                                  "ValidationError:")),
    ("missing.py", {}, "env.verifiers: no such file 'missing.py'"),
])
def test_an_environment_that_fails_to_load_is_named_with_its_own_error(spec, kwargs, message):
    from tokenmill.envs.verifiers_env import load

    with pytest.raises(ConfigError) as err:
        load(spec, kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert "num_taskz" in str(err.value) or "num_taskz" not in str(kwargs)


def test_a_file_that_raises_on_import_is_named(tmp_path):
    from tokenmill.envs.verifiers_env import load

    bad = tmp_path / "bad_env.py"
    bad.write_text("raise ImportError('needs the gpu-only package')\n")
    with pytest.raises(ConfigError, match=r"^env.verifiers: cannot load '.*bad_env.py': ImportError: needs"):
        load(str(bad))


def test_without_the_package_one_line_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "tokenmill.envs.verifiers_env", raising=False)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # `import verifiers.v1` now fails as if not installed
    with pytest.raises(ConfigError) as err:
        importlib.import_module("tokenmill.envs.verifiers_env")
    assert str(err.value).startswith("env.verifiers: needs the verifiers package")
    assert str(err.value).endswith("pip install tokenmill[verifiers]") and "\n" not in str(err.value)


def test_the_command_line_says_it_in_one_line_without_a_traceback(tmp_path, tiny_model_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {tiny_model_path}}}\ndata: {{num_eval: 1}}\n"
                      f"env: {{verifiers: tm_vf_broken}}\ntracking: {{output_dir: {tmp_path / 'out'}}}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ENVS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "train", str(config)], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert ("env.verifiers: 'tm_vf_broken' failed while loading its tasks: FileNotFoundError: rows.parquet: no such "
            "split 'train'") in done.stderr
