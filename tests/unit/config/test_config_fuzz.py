"""Property test: 1,200 invalid configs (wrong types, out-of-range values, unknown keys at every level, missing
sections and fields, incompatible combinations), each written as a YAML file and run through the CLI's own
entry point (`main(["validate", path])`): exit 2, the offending field named at the start of a line, no
traceback. The fields and their bounds are read from the schema, so a new field is fuzzed without a change
here. A few of them also go through a real `tokenmill validate` subprocess."""

from __future__ import annotations

import contextlib
import io
import string
import subprocess
import sys
import tempfile
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types as at
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tokenmill.cli import main
from tokenmill.config import schema as S
from tokenmill.config.rewards import RewardFunctionConfig
from tokenmill.config.section import MAX_INT

# every section of an RL config, with a minimal valid body (dotted path -> model, body)
SECTIONS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "": (S.RLConfig, {}),
    "model": (S.ModelConfig, {"path": "org/model"}),
    "model.lora": (S.LoRAConfig, {}),
    "data": (S.DataConfig, {"task": "addition"}),
    "env": (S.EnvConfig, {"name": "guess_number"}),
    "generation": (S.GenerationConfig, {}),
    "rewards.0": (RewardFunctionConfig, {"function": "tokenmill.data.tasks:addition_reward"}),
    "algorithm": (S.AlgorithmConfig, {}),
    "critic": (S.CriticConfig, {}),
    "critic.lora": (S.LoRAConfig, {}),
    "training": (S.TrainingConfig, {}),
    "controller": (S.ControllerConfig, {}),
    "engine": (S.EngineConfig, {}),
    "proxy": (S.ProxyConfig, {}),
    "tracking": (S.TrackingConfig, {}),
    "checkpoint": (S.CheckpointConfig, {}),
}
FIELDS = [(section, name, info) for section, (model, _) in SECTIONS.items() if section
          for name, info in model.model_fields.items() if name != "type"]


@dataclass(frozen=True)
class Case:
    kind: str
    tree: dict[str, Any]
    field: str  # a line of the error must start with this dotted path


def base_tree(section: str) -> dict[str, Any]:
    """A valid config that contains `section` (so that a change inside it is the only problem)."""
    tree: dict[str, Any] = {"model": {"path": "org/model"}, "data": {"task": "addition"}}
    if section:
        set_path(tree, section, dict(SECTIONS[section][1]), merge=True)
    return tree


def set_path(tree: dict[str, Any], dotted: str, value: Any, merge: bool = False) -> None:
    node: Any = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        if part.isdigit():
            node = node[int(part)]
            continue
        if part == "rewards":
            node = node.setdefault("rewards", [dict(SECTIONS["rewards.0"][1])])
            continue
        node = node.setdefault(part, dict(SECTIONS.get(_prefix(dotted, part), (None, {}))[1]))
    last = parts[-1]
    if last.isdigit():
        node[int(last)] = value
    elif merge and isinstance(node.get(last), dict):
        node[last].update(value)
    elif last == "rewards" and merge:
        node[last] = [value]
    else:
        node[last] = value


def _prefix(dotted: str, part: str) -> str:
    parts = dotted.split(".")
    return ".".join(parts[: parts.index(part) + 1])


def kinds_of(annotation: Any) -> set[Any]:
    """The basic kinds an annotation accepts: int, float, str, bool, list, dict, tuple, model, literal."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return set().union(*(kinds_of(a) for a in typing.get_args(annotation)))
    if origin is typing.Annotated:
        return kinds_of(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return {("literal", typing.get_args(annotation))}
    if origin in (list, dict, tuple):
        return {origin}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {BaseModel}
    return {annotation}


LETTERS = st.text(alphabet=string.ascii_letters, min_size=1, max_size=8).filter(
    lambda s: s.lower() not in {"inf", "nan", "infinity", "e"})
LISTS = st.lists(st.integers(0, 9), min_size=1, max_size=3)
DICTS = st.dictionaries(st.sampled_from("xyz"), st.integers(), min_size=1, max_size=2)


def wrong_values(kinds: set[Any]) -> st.SearchStrategy[Any]:
    """Values none of `kinds` accepts (pydantic's lax mode turns '12' into 12 and 'yes' into True, so numbers
    get letters, booleans get no strings at all)."""
    options: list[st.SearchStrategy[Any]] = []
    literal_choices = {c for k in kinds if isinstance(k, tuple) for c in k[1]}
    numeric = {int, float} & kinds
    if str not in kinds and not literal_choices and bool not in kinds:
        options.append(LETTERS)
    elif literal_choices and str not in kinds:
        options.append(LETTERS.filter(lambda s: s not in literal_choices))
    if not numeric and str not in kinds and bool not in kinds:
        options.append(st.integers(2, 10**6))
    if bool not in kinds and not numeric:
        options.append(st.booleans())
    if numeric and bool not in kinds:
        options.append(st.booleans())  # YAML's true is not 1
    if int in kinds and float not in kinds:
        options.append(st.integers(-1000, 1000).map(lambda n: n + 0.5))
    if list not in kinds and tuple not in kinds:
        options.append(LISTS)
    if dict not in kinds and BaseModel not in kinds:
        options.append(DICTS)
    if bool in kinds:
        options.append(st.floats(0.1, 0.9))
    return st.one_of(options)


@st.composite
def wrong_type(draw) -> Case:
    section, name, info = draw(st.sampled_from(FIELDS))
    value = draw(wrong_values(kinds_of(info.annotation)))
    tree = base_tree(section)
    set_path(tree, f"{section}.{name}", value)
    return Case("wrong type", tree, f"{section}.{name}")


def _bounds(info) -> list[tuple[str, float]]:
    return [(kind, getattr(m, kind)) for m in info.metadata for kind in ("ge", "gt", "le", "lt")
            if isinstance(m, (at.Ge, at.Gt, at.Le, at.Lt)) and hasattr(m, kind)]


RANGED = [(s, n, i) for s, n, i in FIELDS if _bounds(i) or kinds_of(i.annotation) & {int} == {int}]


@st.composite
def out_of_range(draw) -> Case:
    section, name, info = draw(st.sampled_from(RANGED))
    is_int = float not in kinds_of(info.annotation)
    bounds = _bounds(info) + ([("le", MAX_INT)] if is_int else [])
    kind, edge = draw(st.sampled_from(bounds))
    step = draw(st.integers(1, 10**6)) if is_int else draw(st.floats(1e-6, 1e6))
    value = {"ge": edge - step, "gt": edge - step + (0 if is_int else step), "le": edge + step, "lt": edge}[kind]
    if kind == "gt" and draw(st.booleans()):
        value = edge - step
    value = int(value) if is_int else float(value)
    tree = base_tree(section)
    set_path(tree, f"{section}.{name}", value)
    return Case("out of range", tree, f"{section}.{name}")


KEYS = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12)


@st.composite
def unknown_key(draw) -> Case:
    section = draw(st.sampled_from(list(SECTIONS)))
    model = SECTIONS[section][0]
    key = draw(KEYS.filter(lambda k: k not in model.model_fields and k not in ("mode", "estimate", "type")))
    tree = base_tree(section)
    value = draw(st.one_of(st.integers(), LETTERS, LISTS, DICTS))
    if section:
        set_path(tree, f"{section}.{key}", value)
    else:
        tree[key] = value
    return Case("unknown key", tree, f"{section}.{key}" if section else key)


@st.composite
def missing(draw) -> Case:
    which = draw(st.sampled_from(["model", "data", "model.path", "rewards.0.function", "data.source", "env.source"]))
    tree = base_tree("rewards.0" if which.startswith("rewards") else "env" if which.startswith("env") else "")
    if which in ("model", "data"):
        del tree[which]
        return Case("missing section", tree, which)
    if which == "model.path":
        tree["model"] = draw(st.sampled_from([{}, {"device": "cpu"}, {"lora": {"rank": 4}}]))
        return Case("missing field", tree, "model.path")
    if which == "rewards.0.function":
        tree["rewards"] = [{"weight": draw(st.floats(0, 2))}]
        return Case("missing field", tree, "rewards.0.function")
    if which == "data.source":
        tree["data"] = draw(st.sampled_from([{}, {"split": "train"}, {"task": "addition", "path": "x.jsonl"}]))
        return Case("missing field", tree, "data")
    tree["env"] = draw(st.sampled_from([{}, {"max_turns": 3}, {"name": "guess_number", "url": "http://127.0.0.1:1"}]))
    return Case("missing field", tree, "env")


@st.composite
def incompatible(draw) -> Case:
    """Each rule of the schema's cross-field checks, broken with drawn values."""
    n = draw(st.integers(1, 64))
    rules: dict[str, dict[str, Any]] = {
        "generation.group_size": {"generation.group_size": 1,
                                  "algorithm.advantage": draw(st.sampled_from(S.GROUP_BASELINES))},
        "algorithm.mini_batches": {"generation.group_size": 2, "controller.prompts_per_step": n,
                                   "algorithm.mini_batches": 2 * n + draw(st.integers(1, 100))},
        "algorithm.loss": {"algorithm.advantage": "gae", "algorithm.loss": "gspo"},
        "algorithm.kl_in_reward": {"algorithm.kl_in_reward": True,
                                   "algorithm.advantage": draw(st.sampled_from(S.GROUP_BASELINES))},
        "controller.max_staleness": {"controller.max_staleness": n},
        "engine.urls": draw(st.sampled_from([{"engine.placement": "remote"},
                                             {"engine.urls": ["http://127.0.0.1:9"], "engine.placement": "thread"}])),
        "engine.num_servers": {"engine.num_servers": n + 1, "engine.placement": "thread"},
        "engine.sync": draw(st.sampled_from([{"engine.placement": "process", "engine.sync": "inprocess"},
                                             {"engine.placement": "thread", "engine.sync": "files"}])),
        "controller.partial_rollouts": {"controller.partial_rollouts": True},
        "algorithm.off_policy": {"algorithm.off_policy": draw(st.sampled_from(["tis", "decoupled"])),
                                 "algorithm.loss": "gspo"},
        "algorithm.overlong_buffer": {"generation.max_tokens": n, "algorithm.overlong_buffer": n + draw(st.integers(0, 9))},
        "proxy": {"proxy.port": 0, "engine.placement": "thread"},
        "controller.prompts_per_step": {"controller.prompts_per_step": 1 << 21, "generation.group_size": 4},
    }
    field = draw(st.sampled_from(sorted(rules)))
    tree = base_tree("")
    for key, value in rules[field].items():
        set_path(tree, key, value)
    return Case("incompatible", tree, field)


@st.composite
def whole_section_wrong(draw) -> Case:
    section = draw(st.sampled_from([s for s in SECTIONS if s and "." not in s]))
    tree = base_tree(section)
    bad = draw(st.one_of(st.integers(), LETTERS, LISTS if section != "rewards" else DICTS))
    tree[section.split(".")[0]] = bad if section != "rewards.0" else draw(st.one_of(st.integers(), LETTERS))
    return Case("section wrong type", tree, section.split(".")[0])


INVALID = st.one_of(wrong_type(), out_of_range(), unknown_key(), missing(), incompatible(), whole_section_wrong())


def validate_in_process(tree: dict[str, Any], folder: Path) -> tuple[int, str]:
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", str(path)])
    return code, out.getvalue() + err.getvalue()


def names_field(output: str, field: str) -> bool:
    return any(line == field or line.startswith((f"{field}:", f"{field}.")) for line in output.splitlines())


def test_1200_invalid_configs_are_rejected_naming_the_field():
    seen: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as folder:

        @settings(max_examples=1200, deadline=None, database=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        @given(INVALID)
        def check(case: Case) -> None:
            code, output = validate_in_process(case.tree, Path(folder))
            assert code == 2, (case, output)
            assert "Traceback" not in output
            assert output.startswith("tokenmill: invalid configuration\n"), output
            assert names_field(output, case.field), (case, output)
            seen[case.kind] += 1

        check()
    assert sum(seen.values()) >= 1000, seen
    assert set(seen) == {"wrong type", "out of range", "unknown key", "missing section", "missing field",
                         "incompatible", "section wrong type"}, seen


SPOT_CHECKS = [
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "generation": {"temperature": "hot"}},
     "generation.temperature"),
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "critic": {"lora": {"rank": -1}}}, "critic.lora.rank"),
    ({"model": {"path": "m"}, "data": {"task": "addition"}, "engine": {"placement": "remote"}}, "engine.urls"),
    ({"data": {"task": "addition"}}, "model"),
]


def test_spot_checks_through_the_installed_command(tmp_path):
    exe = Path(sys.executable).with_name("tokenmill")  # the console script, as a user runs it
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "tokenmill.cli"]
    for tree, field in SPOT_CHECKS:
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(tree))
        done = subprocess.run([*command, "validate", str(path)], capture_output=True, text=True, check=False,
                              timeout=60)
        assert done.returncode == 2 and done.stdout == ""
        assert "Traceback" not in done.stderr and names_field(done.stderr, field), done.stderr
