"""Names in `src/tokenmill` that a reader can trust: a public class name means one class, and every error the
library raises can be caught as `tokenmill.types.TokenmillError`. Read with `ast`, nothing imported."""

from __future__ import annotations

import ast
import builtins
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tokenmill"
ROOT_ERROR = "TokenmillError"
# Runs inside the sandbox before anything else, on the system interpreter, importing nothing from tokenmill.
STANDALONE = {PACKAGE / "sandbox" / "_boot.py"}


def classes(package: Path = PACKAGE) -> list[tuple[str, list[str], str]]:
    """(name, base names, 'file:line') of every class in the package, nested ones included."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                found.append((node.name, bases, f"{path.relative_to(package.parent)}:{node.lineno}"))
    return found


def _builtin_exception(name: str) -> bool:
    obj = getattr(builtins, name, None)
    return isinstance(obj, type) and issubclass(obj, BaseException)


def error_classes_outside_the_root(package: Path = PACKAGE) -> list[str]:
    """Public exception classes that do not derive, through classes of the package, from TokenmillError."""
    found = [c for c in classes(package) if Path(package.parent / c[2].split(":")[0]) not in STANDALONE]
    bases: dict[str, set[str]] = defaultdict(set)
    for name, names, _ in found:
        bases[name].update(names)

    def reaches(name: str, goal, seen: frozenset = frozenset()) -> bool:
        if goal(name):
            return True
        return name not in seen and any(reaches(b, goal, seen | {name}) for b in bases.get(name, ()))

    return [
        f"{where} {name}({', '.join(names)})" for name, names, where in found
        if not name.startswith("_") and name != ROOT_ERROR and reaches(name, _builtin_exception)
        and not reaches(name, lambda n: n == ROOT_ERROR)
    ]


def duplicated_public_names(package: Path = PACKAGE) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for name, _, place in classes(package):
        if not name.startswith("_"):
            where[name].append(place)
    return {name: places for name, places in where.items() if len(places) > 1}


def test_no_public_class_name_is_defined_twice():
    """Two `EngineUnavailable`s (or two `Episode`s) make `except` and imports catch the wrong one."""
    dupes = duplicated_public_names()
    assert not dupes, "\n".join(f"{name}: {', '.join(places)}" for name, places in sorted(dupes.items()))


def test_every_public_error_derives_from_tokenmill_error():
    """A caller can catch everything tokenmill raises with one `except TokenmillError`; a stdlib base may stay
    as a second base where callers catch it (`class ChatTemplateError(TokenmillError, ValueError)`)."""
    outside = error_classes_outside_the_root()
    assert not outside, "derive these from tokenmill.types.TokenmillError:\n" + "\n".join(outside)


def test_the_checks_catch_what_they_claim(tmp_path):
    pkg = tmp_path / "tokenmill"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "types.py").write_text("class TokenmillError(Exception):\n    pass\n")
    (pkg / "a.py").write_text(
        "class Good(TokenmillError, ValueError): ...\n"
        "class Child(Good): ...\n"
        "class Bad(RuntimeError): ...\n"
        "class _Private(Exception): ...\n"
        "class NotAnError: ...\n"
        "class Twice: ...\n"
    )
    (pkg / "sub" / "b.py").write_text(
        "def f():\n    class Twice: ...\n"
        "class StillBad(Bad): ...\n"
        "class _Private: ...\n"
    )
    assert duplicated_public_names(pkg) == {"Twice": ["tokenmill/a.py:6", "tokenmill/sub/b.py:2"]}
    assert error_classes_outside_the_root(pkg) == ["tokenmill/a.py:3 Bad(RuntimeError)",
                                                   "tokenmill/sub/b.py:3 StillBad(Bad)"]
