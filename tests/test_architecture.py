"""The shape of `src/tokenmill`, checked so that it stays: which package may import which, the training
loop's line budget, and the size caps on files and functions.

Everything here reads the source with `ast` (nothing is imported), so a rule is checked even for code that
only runs on a GPU or a cluster. Each failure names the file and line to look at.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tokenmill"

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
LOOP_LINE_BUDGET = 80  # `run_rl`, the one training loop: a reader holds it on one screen


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    module: str  # absolute dotted name, relative imports resolved
    top_level: bool  # runs when the module is imported (not inside a function, not under TYPE_CHECKING)
    type_only: bool = False  # under `if TYPE_CHECKING:`: never runs

    def __str__(self) -> str:
        return f"{self.file.relative_to(SRC)}:{self.line} imports {self.module}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(path: Path, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        package = module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    # `from tokenmill import testing` imports the submodule tokenmill.testing
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def imports(path: Path) -> list[Import]:
    """Every import in `path`, with whether it runs at import time."""
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(path, child.lineno, a.name, top_level, type_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend(Import(path, child.lineno, m, top_level, type_only) for m in _resolve(path, child))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for branch in child.body:  # the `else:` of a TYPE_CHECKING test runs
                    visit(ast.Module(body=[branch], type_ignores=[]), False, True)
                for branch in child.orelse:
                    visit(ast.Module(body=[branch], type_ignores=[]), top_level, type_only)
            else:
                deferred = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, top_level and not deferred, type_only)

    visit(parse(path), True, False)
    return found


def under(path: Path, package: str) -> bool:
    return module_name(path) == package or module_name(path).startswith(package + ".")


def names(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def all_imports() -> list[Import]:
    return [imp for path in source_files() for imp in imports(path)]


def report(bad: list[Import]) -> str:
    """One line per import statement (`from a import b` is both `a` and `a.b`)."""
    seen: dict[tuple[Path, int], Import] = {}
    for imp in bad:
        seen.setdefault((imp.file, imp.line), imp)
    return "\n".join(str(i) for i in seen.values())


# --- the checker checks what it claims (on snippets written to a temporary package) -------------------------


def test_the_import_reader_resolves_relative_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "tokenmill" / "engines"
    (pkg / "server").mkdir(parents=True)
    (pkg / "local").mkdir()
    (pkg / "server" / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from ...envs import server\n"
        "from ..local import hf\n"
        "from . import streaming\n"
        "if TYPE_CHECKING:\n"
        "    import ray\n"
        "else:\n"
        "    import httpx\n"
        "def f():\n"
        "    import tokenmill.testing.tiny\n"
    )
    (pkg / "local" / "__init__.py").write_text("from .sampling import sample_rows\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    got = {(i.module, i.top_level, i.type_only) for i in imports(pkg / "server" / "x.py")}
    assert got == {
        ("typing", True, False), ("typing.TYPE_CHECKING", True, False), ("torch", True, False),
        ("tokenmill.envs", True, False), ("tokenmill.envs.server", True, False),
        ("tokenmill.engines.local", True, False), ("tokenmill.engines.local.hf", True, False),
        ("tokenmill.engines.server", True, False), ("tokenmill.engines.server.streaming", True, False),
        ("ray", False, True), ("httpx", True, False), ("tokenmill.testing.tiny", False, False),
    }
    got = {i.module for i in imports(pkg / "local" / "__init__.py")}
    assert got == {"tokenmill.engines.local.sampling", "tokenmill.engines.local.sampling.sample_rows"}


def test_the_cycle_finder_finds_each_cycle_once():
    edges = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"], ("c", "d"): ["c.py:4"]}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({k: v for k, v in edges.items() if k != ("c", "a")}) == []


# --- import direction --------------------------------------------------------------------------------------


def test_engines_do_not_import_envs():
    """Engines sample tokens; environments are a layer above (the agent loop joins them). Shared server code
    lives in its own module that both import."""
    bad = [i for i in all_imports() if under(i.file, "tokenmill.engines") and names(i.module, "tokenmill.envs")]
    assert not bad, report(bad)


def test_the_library_does_not_import_testing():
    """`tokenmill.testing` holds test helpers; a user's run never needs them."""
    bad = [
        i for i in all_imports()
        if not under(i.file, "tokenmill.testing") and names(i.module, "tokenmill.testing")
    ]
    assert not bad, report(bad)


def test_ray_only_in_the_controller():
    """Ray is an optional dependency for scale-out; only the controller package may know it exists."""
    bad = [i for i in all_imports() if names(i.module, "ray") and not under(i.file, "tokenmill.controller")]
    assert not bad, report(bad)


def test_the_controller_defines_no_engine():
    """The controller places engines and drives them; an engine's behaviour (a seeded client, a wrapper) is an
    engine class or option under `engines/`, where its tests are."""
    bad = [
        f"{p.relative_to(SRC)}:{node.lineno} class {node.name}({ast.unparse(base)})"
        for p in source_files() if under(p, "tokenmill.controller")
        for node in ast.walk(parse(p)) if isinstance(node, ast.ClassDef)
        for base in node.bases if ast.unparse(base).split(".")[-1].endswith("Engine")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["tokenmill.envs", "tokenmill.rewards"])
def test_envs_and_rewards_import_no_torch_or_ray_at_import_time(package):
    """Environments and rewards run in CPU-only sandboxes and env servers: importing them must stay cheap.
    A function that needs torch imports it where it is used."""
    bad = [
        i for i in all_imports()
        if under(i.file, package) and i.top_level and (names(i.module, "torch") or names(i.module, "ray"))
    ]
    assert not bad, report(bad)


def test_the_cli_does_not_import_the_composer_at_import_time():
    """`tokenmill train` and `tokenmill estimate` must work without the UI's dependencies loaded; only the
    `composer` subcommand imports it, inside its function."""
    cli = PACKAGE / "cli.py"
    bad = [i for i in imports(cli) if i.top_level and names(i.module, "tokenmill.composer")]
    assert not bad, report(bad)



def test_importing_the_cli_loads_no_composer_module():
    """The same, through every module the CLI imports (one fresh interpreter, so nothing is loaded yet)."""
    probe = ("import sys, tokenmill.cli; "
             "print(sorted(m for m in sys.modules if m.startswith('tokenmill.composer')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


# --- no package cycles -----------------------------------------------------------------------------------

# Runtime imports (at import time or inside a function) that are allowed to close a cycle, each with why.
# Imports under `if TYPE_CHECKING:` never run and never count.
ALLOWED_LAZY_EDGES = {
    # config validates `env.name` and `data.task` against the environment and task registries. The registries
    # import `config.imports.resolve` (envs) and the environments (data) at import time, so config imports
    # them late, inside the validator, and only for the registries' names (no environment class is loaded).
    ("tokenmill.config", "tokenmill.envs"): "config/preflight.py `_env_problem`: `envs.BUILTIN_ENVS`, names only",
    ("tokenmill.config", "tokenmill.data"): "config/schema.py `DataConfig`: `data.registry.task_problem`",
}


def package_of(module: str, level: str) -> str | None:
    """The child of `level` that `module` is in (`tokenmill.engines.local.hf` at level `tokenmill.engines`:
    `tokenmill.engines.local`); None outside `level`."""
    if not module.startswith(level + "."):
        return None
    return level + "." + module[len(level) + 1:].split(".")[0]


def package_edges(level: str) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the import lines, between the children of `level`, for every
    import that runs (top level or in a function; not under TYPE_CHECKING), the allowed lazy ones left out."""
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in all_imports():
        source, target = package_of(module_name(imp.file), level), package_of(imp.module, level)
        if imp.type_only or source is None or target is None or source == target:
            continue
        if (source, target) in ALLOWED_LAZY_EDGES and not imp.top_level:
            continue
        found = edges.setdefault((source, target), [])
        if not any(line.startswith(f"{imp.file.relative_to(SRC)}:{imp.line} ") for line in found):
            found.append(str(imp))  # one line per statement (`from a import b` is both `a` and `a.b`)
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node (each sorted): every package in one imports, through
    the others, itself."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {node: reaches(node) for node in graph}
    found = {tuple(sorted(n for n in graph if n in reach[node] and node in reach[n])) for node in graph}
    return sorted(list(c) for c in found if len(c) > 1)


@pytest.mark.parametrize("level", ["tokenmill", "tokenmill.engines"])
def test_no_import_cycle_between_packages(level):
    """Packages (and a package's role sub-packages) form layers: if a imports b, b imports nothing of a, at
    import time or in a function. Only a type annotation may point back (under TYPE_CHECKING); a lazy import
    that must close a cycle is listed in ALLOWED_LAZY_EDGES with the reason."""
    edges = package_edges(level)
    problems = []
    for cycle in cycles(edges):
        lines = [line for (a, b), found in edges.items() if a in cycle and b in cycle for line in found]
        problems.append(f"cycle {' <-> '.join(cycle)}:\n  " + "\n  ".join(sorted(lines)))
    assert not problems, "\n".join(problems)


def test_the_allowed_lazy_edges_are_still_needed_and_still_lazy():
    """Each allowed edge exists (else delete it from ALLOWED_LAZY_EDGES) and never runs at import time."""
    for source, target in ALLOWED_LAZY_EDGES:
        found = [i for i in all_imports() if under(i.file, source) and names(i.module, target) and not i.type_only]
        assert found, f"{source} no longer imports {target}: remove the allowance"
        eager = [i for i in found if i.top_level]
        assert not eager, report(eager)


# --- engines: one sub-package per role --------------------------------------------------------------------

ENGINE_ROLES = {"local", "server", "remote", "vllm"}


def test_engines_are_sub_packages_by_role_next_to_the_protocol():
    """`ls engines` draws the four roles: the model in process, the `tokenmill serve` server, the clients of
    remote servers, vLLM. Directly under engines/ only the protocol."""
    engines = PACKAGE / "engines"
    roles = {p.name for p in engines.iterdir() if (p / "__init__.py").exists()}
    assert roles == ENGINE_ROLES
    assert sorted(p.name for p in engines.glob("*.py")) == ["__init__.py", "base.py"]


def test_the_local_engines_do_not_import_the_server():
    """The server sits on top of an engine; an in-process engine never needs an HTTP layer."""
    bad = [
        i for i in all_imports()
        if under(i.file, "tokenmill.engines.local") and names(i.module, "tokenmill.engines.server")
    ]
    assert not bad, report(bad)


def test_engines_do_not_import_rollout():
    """Rollouts drive engines (and the proxy collector reads the server's recorder); an engine never drives a
    rollout, so the tie runs one way."""
    bad = [i for i in all_imports() if under(i.file, "tokenmill.engines") and names(i.module, "tokenmill.rollout")]
    assert not bad, report(bad)


# which train backend classes each file may construct: the policy's from a `TrainerSpec` (`policy_backend`), a
# sharded backend's own local one, the critic's optimiser; the Ray trainer where a run's trainer is picked
TRAINER_BUILDERS = {
    "LocalBackend": {"tokenmill/training/spec.py", "tokenmill/training/sharded.py", "tokenmill/training/critic.py"},
    "ShardedBackend": {"tokenmill/training/spec.py"},
    "RayBackend": {"tokenmill/controller/trainer.py"},
}


def test_the_trainer_is_built_in_one_place():
    """Every policy trainer (a run's local, FSDP2 or Ray backend, the offline trainers, the training client) is
    built from a `TrainerSpec` by `training.spec.policy_backend`, and a run's by `controller.trainer.build_trainer`:
    an option added to the spec then reaches every backend (tests/contracts/test_trainer_spec_contract.py)."""
    bad = []
    for path in source_files():
        where = str(path.relative_to(SRC))
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name in TRAINER_BUILDERS and where not in TRAINER_BUILDERS[name]:
                    bad.append(f"{where}:{node.lineno} constructs {name} (build it through policy_backend)")
    assert not bad, "\n".join(bad)


# --- sizes ---------------------------------------------------------------------------------------------------


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(parse(path)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def span(node: ast.AST) -> int:
    """Lines from the `def` (or its first decorator) to the last line of the body, docstring included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def test_the_training_loop_fits_its_line_budget():
    rl = PACKAGE / "controller" / "rl.py"
    [run_rl] = [f for f in functions(rl) if f.name == "run_rl"]
    assert span(run_rl) <= LOOP_LINE_BUDGET, (
        f"{rl.relative_to(SRC)}:{run_rl.lineno} run_rl is {span(run_rl)} lines (budget {LOOP_LINE_BUDGET}): "
        "move a step into a named helper or a feed"
    )


def test_no_source_file_over_the_cap():
    long = [
        f"{p.relative_to(SRC)}: {n} lines" for p in source_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_source_function_over_the_cap():
    long = [
        f"{p.relative_to(SRC)}:{f.lineno} {f.name}: {span(f)} lines"
        for p in source_files() for f in functions(p) if span(f) > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_unit_tests_mirror_the_source_tree():
    """tests/unit/<package>/ for each package's tests (tests/unit/engines/local/ for engines/local/); directly
    under tests/unit only tests of the top-level modules (test_cli_env.py tests cli.py): a reader finds a
    module's tests where the module is."""
    package = SRC / "tokenmill"
    unit = SRC.parent / "tests" / "unit"
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= subpackages, f"tests/unit folders with no package of that name: {sorted(folders - subpackages)}"
    nested = [str(p.relative_to(unit)) for p in unit.glob("*/**/") if p.parent != unit and p != unit
              and p.name != "__pycache__" and not (package / p.relative_to(unit) / "__init__.py").exists()]
    assert nested == [], f"tests/unit folders deeper down with no package of that path: {nested}"
    stray = [p.name for p in unit.glob("test_*.py")
             if not any(p.stem == f"test_{m}" or p.stem.startswith(f"test_{m}_") for m in modules)]
    assert stray == [], f"move these into tests/unit/<package>/: {stray}"


def test_test_files_have_unique_names():
    """pytest imports test files by their base name (the test folders are not packages): two files of one name
    stop the whole collection."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    twins = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            twins.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen.setdefault(path.name, path)
    assert not twins, "test files sharing a name: " + "; ".join(twins)
