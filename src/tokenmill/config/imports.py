"""The one import-string resolver: a config names user code as 'package.module:attr' or 'path/to/file.py:attr'.

Rewards (`rewards[].function`), environments (`env.name`, `tokenmill env serve`) and the Composer's preview all
resolve through `resolve`, so anything that can live in a module can also live in a file next to the config.
Every failure is a `ConfigError` that starts with the field it came from.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenmill.types import ConfigError


def resolve(spec: str, field: str) -> Any:
    """The object `spec` names: 'package.module:attr' or 'path/to/file.py:attr' (a relative path is taken
    from the current directory); `attr` may be dotted ('module:Class.method')."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}: {spec!r} must look like 'package.module:Name' or 'path/to/file.py:Name'")
    obj: Any = load_file(module_name, field) if module_name.endswith(".py") else _import(module_name, field)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _import(module_name: str, field: str) -> ModuleType:
    """Import a module; one that is not found is looked for in the current directory too, as `python -m`
    finds it (the `tokenmill` command's sys.path holds only its own folder), so 'hotcold:HotCold' next to
    the config works without PYTHONPATH. The directory goes last: it never shadows an installed package."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != module_name.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise ConfigError(f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
        sys.path.append(cwd)
        return _import(module_name, field)
    except Exception as exc:  # noqa: BLE001 - any failure of user code at import is a config problem to report
        raise ConfigError(f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None


def load_file(path: str, field: str) -> ModuleType:
    """A Python file loaded as a module (e.g. reward code the Composer wrote, or an environment beside the
    config). It is registered in sys.modules under a name derived from its absolute path, so loading the same
    file twice gives the same module (and the same classes, which `isinstance` and pickling rely on)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{field}: no such file {path!r}")
    name = "tokenmill_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{field}: cannot load {path!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code that fails to load is a config problem to report
        del sys.modules[name]
        raise ConfigError(f"{field}: cannot load {path!r}: {type(exc).__name__}: {exc}") from None
    return module
