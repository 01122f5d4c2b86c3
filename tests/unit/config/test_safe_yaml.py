"""Hostile config files: alias bombs, huge files and values, deep nesting, duplicate keys. Each is refused
quickly, in little memory, with a short message."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from tokenmill.config import RLConfig, load_config
from tokenmill.config.safe_yaml import MAX_ALIASES, MAX_FILE_BYTES, load_yaml_text, shorten
from tokenmill.types import ConfigError

# "billion laughs": 9 levels of 9 aliases, 9**9 strings once expanded, 300-odd bytes on disk
LEVELS = "abcdefghi"
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{','.join(['*' + p] * 9)}]\n" for p, x in itertools.pairwise(LEVELS))


def test_the_bomb_is_small():
    assert len(BOMB.encode()) < 400 and BOMB.count("*") == 72


def test_billion_laughs_is_refused_in_under_a_second_and_200_mb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    # a parent that starts nothing else, so RUSAGE_CHILDREN measures the validate processes alone; the best of
    # three walls (the machine may be busy), the largest RSS
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "walls = []\n"
        "for _ in range(3):\n"
        "    t = time.perf_counter()\n"
        "    done = subprocess.run([sys.executable, '-m', 'tokenmill.cli', 'validate', sys.argv[1]],\n"
        "                          capture_output=True, text=True, check=False)\n"
        "    walls.append(time.perf_counter() - t)\n"
        "rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(json.dumps({'code': done.returncode, 'err': done.stderr, 'wall': min(walls), 'rss_mb': rss_mb}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=False,
                          timeout=120)
    result = json.loads(done.stdout)
    assert result["code"] == 2
    assert result["err"].splitlines()[1] == (
        f"{path}: line 9: more than {MAX_ALIASES} YAML aliases (*name); write the values out instead")
    assert result["rss_mb"] < 200, result
    assert result["wall"] < 1.0, result


def test_the_composer_import_uses_the_same_reader():
    from tokenmill.composer.configs import import_yaml

    start = time.perf_counter()
    answer = import_yaml(BOMB)
    assert time.perf_counter() - start < 1.0
    assert answer["config"] == {}
    assert answer["errors"] == [{"path": "yaml", "message": f"line 9: more than {MAX_ALIASES} YAML aliases (*name); "
                                                            "write the values out instead"}]
    assert len(json.dumps(answer)) < 500


def test_a_few_aliases_still_work_and_are_not_shared():
    tree = load_yaml_text("base: &b {path: m, lora: {rank: 4}}\nmodel: *b\ncritic: {<<: *b, path: c}\n")
    assert tree == {"base": {"path": "m", "lora": {"rank": 4}}, "model": {"path": "m", "lora": {"rank": 4}},
                    "critic": {"path": "c", "lora": {"rank": 4}}}
    tree["model"]["lora"]["rank"] = 8  # editing one copy leaves the others alone (overrides edit in place)
    assert tree["base"]["lora"]["rank"] == 4 and tree["critic"]["lora"]["rank"] == 4


def test_expansion_under_the_alias_bound_is_still_capped():
    # 6 levels of 8 aliases: 48 aliases (allowed) but 8**6 = 262,144 values once expanded
    text = "a: &a [1,1,1,1,1,1,1,1]\n" + "".join(
        f"{x}: &{x} [{','.join(['*' + p] * 8)}]\n" for p, x in zip("abcdef", "bcdefg", strict=True))
    assert text.count("*") <= MAX_ALIASES
    with pytest.raises(ConfigError, match=r"^more than 100,000 values once aliases are expanded$"):
        load_yaml_text(text)


def test_a_long_string_aliased_many_times_is_refused():
    text = 'a: &a "' + "x" * 500_000 + '"\nb: [' + ", ".join(["*a"] * 8) + "]\n"
    assert len(text) < MAX_FILE_BYTES
    with pytest.raises(ConfigError, match=r"^more than 2,097,152 characters of text once aliases are expanded$"):
        load_yaml_text(text)
    from tokenmill.composer.configs import import_yaml

    assert len(json.dumps(import_yaml(text))) < 500


def test_deep_nesting_is_refused():
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        load_yaml_text("a: " + "[" * 100 + "]" * 100)
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        load_yaml_text("[" * 5000 + "]" * 5000)


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("model: {path: m}\ndata: {task: addition}\n# " + "x" * MAX_FILE_BYTES + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, path)
    assert str(err.value) == f"{path}: {path.stat().st_size:,} bytes; a config file is at most {MAX_FILE_BYTES:,}"


def test_duplicate_keys_at_any_level(tmp_path):
    with pytest.raises(ConfigError, match=r"^line 2: key 'a' appears twice \(first on line 1\)"):
        load_yaml_text("a: 1\na: 2\n")
    with pytest.raises(ConfigError, match=r"^line 3: key 'rank' appears twice \(first on line 2\)"):
        load_yaml_text("lora:\n  rank: 4\n  rank: 8\n")
    with pytest.raises(ConfigError, match=r"^line 1: key 'a' appears twice \(first on line 1\)"):
        load_yaml_text("{a: 1, a: 2}")


def test_a_10_mb_value_is_not_echoed(tmp_path, capsys):
    from tokenmill.cli import main

    huge = "x" * 10_000_000
    base = {"model": {"path": "m"}, "data": {"task": "addition"}}
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {**base, "training": {"lr": huge}})
    assert str(err.value) == "training.lr: unknown field; did you mean learning_rate?"  # the value is not shown
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, {**base, huge: 1})
    assert len(str(err.value)) < 200 and str(err.value).startswith("x" * 40 + "...: unknown field")
    with pytest.raises(ConfigError) as err:  # nested lists: a few items per level, not the whole value
        load_config(RLConfig, base, {"generation.stop": [[huge] * 1000] * 1000})
    lines = str(err.value).splitlines()
    assert len(lines) == 21 and lines[-1] == "... and 980 more problems"
    assert all(len(line) < 300 for line in lines)
    assert main(["validate", "--model.path", "m", "--data.task", "addition", "--generation.top_k", huge]) == 2
    assert len(capsys.readouterr().err) < 400


def test_shorten_is_bounded():
    assert shorten("abc") == "'abc'"
    assert len(shorten("y" * 10**7)) < 80
    assert shorten(list(range(100))) == "[0, 1, 2, 3, ...]"
