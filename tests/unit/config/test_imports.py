"""The one import-string resolver (`tokenmill.config.imports.resolve`): 'module:attr' and 'file.py:attr' for
rewards, environments and the Composer, with errors that name the field."""

from __future__ import annotations

import json

import pytest

from tokenmill.config.imports import resolve
from tokenmill.envs import resolve_env
from tokenmill.types import ConfigError

HOT_COLD = '''
class HotCold:
    """Guess the secret; a wrong guess is told 'higher' or 'lower', the right one ends with reward 1."""

    def __init__(self, limit=9):
        self.limit = limit

    def reset(self, task):
        self.secret = task["secret"]
        return [{"role": "user", "content": f"1-{self.limit}"}]

    def step(self, message):
        from tokenmill.envs import StepResult

        text = message["content"].strip()
        if not text.isdigit():
            return StepResult([{"role": "user", "content": "digits only"}])
        guess = int(text)
        if guess == self.secret:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])


def tasks(n, seed=0):
    return [{"prompt": "hot-cold", "secret": 3 + (seed + i) % 5} for i in range(n)]
'''


def test_an_environment_can_live_in_a_file_like_a_reward(tmp_path, monkeypatch):
    (tmp_path / "mygame.py").write_text(HOT_COLD)
    monkeypatch.chdir(tmp_path)  # a relative path is read from the current directory, as for rewards
    factory = resolve_env("mygame.py:HotCold", {"limit": 7})
    env = factory()
    assert env.limit == 7
    assert env.reset({"secret": 5}) == [{"role": "user", "content": "1-7"}]
    low = env.step({"role": "assistant", "content": "2"})
    assert (low.observation, low.reward, low.done) == ([{"role": "user", "content": "higher"}], 0.0, False)
    hit = env.step({"role": "assistant", "content": "5"})
    assert (hit.reward, hit.done) == (1.0, True)
    # the file is loaded once: the absolute path names the same class
    assert resolve_env(f"{tmp_path / 'mygame.py'}:HotCold") is type(env)


def test_an_environment_in_a_file_trains_through_the_config(tmp_path, monkeypatch, tiny_model_path):
    import tokenmill

    (tmp_path / "mygame.py").write_text(HOT_COLD)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in resolve("mygame.py:tasks", "t")(8)))
    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"path": "rows.jsonl", "num_eval": 0},
        "env": {"name": "mygame.py:HotCold", "max_turns": 2, "max_episode_tokens": 64},
        "generation": {"group_size": 2, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": str(tmp_path / "run"), "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    result = tokenmill.train(cfg)
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "reward/mean" in line]
    assert row["step"] == 1 and 0.0 <= row["reward/env/mean"] <= 1.0
    assert row["agent/failed_episodes"] == 0 and row["reward/env/failed"] == 0  # the file's env ran every episode
    assert result["last_metrics"]["reward/mean"] == row["reward/mean"]  # the one step trained on the env's returns


def test_module_and_file_specs_resolve_dotted_attributes(tmp_path):
    assert resolve("tokenmill.data.tasks:addition_reward", "rewards.0.function")([""], ["3"], ["3"]) == [1.0]
    (tmp_path / "r.py").write_text("class Scores:\n    @staticmethod\n    def one(p, c, **kw):\n        return [1.0] * len(c)\n")
    assert resolve(f"{tmp_path / 'r.py'}:Scores.one", "rewards.0.function")([], ["a", "b"]) == [1.0, 1.0]


@pytest.mark.parametrize("spec, message", [
    ("HotCold", "env.name: 'HotCold' must look like 'package.module:Name' or 'path/to/file.py:Name'"),
    ("no_such_module_xyz:Env", "env.name: cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("tokenmill.envs:Nope", "env.name: module 'tokenmill.envs' has no attribute 'Nope'"),
    ("missing.py:Env", "env.name: no such file 'missing.py'"),
    ("tokenmill.envs:BUILTIN_ENVS", "env.name: 'tokenmill.envs:BUILTIN_ENVS' names a dict, not a class or factory"),
])
def test_environment_spec_errors_name_the_field(spec, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        resolve_env(spec)
    assert str(err.value).startswith(message)


def test_a_file_that_fails_to_load_is_reported_and_not_cached(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("1/0\n")
    with pytest.raises(ConfigError, match=r"^env.name: cannot load .*bad.py': ZeroDivisionError: division by zero"):
        resolve(f"{bad}:Env", "env.name")
    bad.write_text("class Env:\n    pass\n")  # fixed: the next resolve loads it afresh
    assert resolve(f"{bad}:Env", "env.name").__name__ == "Env"


def test_import_strings_are_resolved_in_one_place():
    """Only the resolver imports user code by name or loads it from a file (the package's lazy attributes in
    `tokenmill/__init__.py` import its own modules by name)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[3] / "src" / "tokenmill"
    allowed = {package / "config" / "imports.py": {"import_module", "spec_from_file_location"},
               package / "__init__.py": {"import_module"}}
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            attr = node.attr if isinstance(node, ast.Attribute) else None
            if attr in ("import_module", "spec_from_file_location") and attr not in allowed.get(path, set()):
                found.append(f"{path.relative_to(package)}:{node.lineno} {attr}")
    assert not found, "resolve import strings with tokenmill.config.imports.resolve:\n" + "\n".join(found)


REWARDS_MODULE = '''
def hot_reward(completions, **kwargs):
    return [0.25 for _ in completions]
'''


def _tokenmill(cwd, *args: str):
    """The CLI as the installed command runs it: the current directory is not on sys.path (-P), no PYTHONPATH."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-P", "-m", "tokenmill.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_module_specs_resolve_from_the_current_directory_in_validate_and_train(tmp_path, tiny_model_path):
    import yaml

    (tmp_path / "hotcold.py").write_text(HOT_COLD)
    (tmp_path / "hotrewards.py").write_text(REWARDS_MODULE)
    tasks = [{"prompt": "hot-cold", "secret": 3 + i % 5} for i in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tasks))
    cfg = {
        "model": {"path": tiny_model_path, "device": "cpu"},
        "data": {"path": "rows.jsonl", "num_eval": 0},
        "env": {"name": "hotcold:HotCold", "max_turns": 1, "max_episode_tokens": 64},
        "rewards": [{"function": "hotrewards:hot_reward"}],
        "generation": {"group_size": 2, "max_tokens": 2},
        "controller": {"steps": 1, "prompts_per_step": 2},
        "tracking": {"output_dir": "run", "console": "none"},
        "checkpoint": {"every": 0, "save_final": False},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    done = _tokenmill(tmp_path, "validate", "cfg.yaml")
    assert done.returncode == 0, done.stderr
    assert "cfg.yaml: valid." in done.stdout
    # the file form too, as rewards take it
    (tmp_path / "file.yaml").write_text(yaml.safe_dump(cfg | {"env": cfg["env"] | {"name": "hotcold.py:HotCold"}}))
    assert _tokenmill(tmp_path, "validate", "file.yaml").returncode == 0
    # a module that is not there is still refused by validate, naming the field
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg | {"env": cfg["env"] | {"name": "nothere:HotCold"}}))
    bad = _tokenmill(tmp_path, "validate", "bad.yaml")
    assert bad.returncode == 2
    assert "env.name: cannot import module 'nothere': ModuleNotFoundError: No module named 'nothere'" in bad.stderr
    done = _tokenmill(tmp_path, "train", "cfg.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "reward/mean" in line]
    assert row["agent/failed_episodes"] == 0
