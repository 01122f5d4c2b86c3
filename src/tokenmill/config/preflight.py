"""What can be checked about a run without loading a model: files, dataset columns, devices, references.

`tokenmill validate` runs these checks, and so do `tokenmill train` / `eval` and `tokenmill.train` before
anything heavy starts, so that a missing file, a dataset without the column a reward needs or a device the
machine lacks is one line naming the field, not a traceback minutes later. Nothing here imports torch,
transformers or datasets, except torch when the config names an accelerator (to ask whether it exists) or
pushes a tied model's weights into vLLM on this machine (to ask whether that vLLM runs on the CPU), and
torch and transformers when `model.lora.target_modules` lists modules: the model is then built on the meta
device from its config.json (no weights read, no memory taken) to learn its module names.
"""

from __future__ import annotations

import csv
import importlib.util
import inspect
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tokenmill.config.imports import resolve
from tokenmill.config.rewards import RewardFunctionConfig, RewardModelConfig
from tokenmill.config.schema import ModelConfig, RLConfig
from tokenmill.types import ConfigError

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
HEAD_ROWS = 20  # rows read to learn a file's columns (and to find a broken line early)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # `name` or `org/name`
# what tokenmill hands every reward function besides the dataset's columns (TRL's keyword arguments)
REWARD_ARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})


def _q(text: str) -> str:
    """A path or name as shown in a message: quoted, and cut when it is very long."""
    return repr(text if len(text) <= 200 else text[:200] + "...")


def _kind(path: str | Path) -> str:
    """'dir', 'file' or 'missing'; a name the OS refuses (too long, a NUL byte) is missing too."""
    try:
        p = Path(path).expanduser()
        return "dir" if p.is_dir() else "file" if p.exists() else "missing"
    except (OSError, ValueError):
        return "missing"


def _looks_local(path: str) -> bool:
    """A path the user means as a local file or folder, as opposed to a hub id such as `org/name`."""
    return _kind(path) != "missing" or not HUB_ID.match(path) or path.endswith(DATA_SUFFIXES)


# ------------------------------------------------------------------------------------------------ models


def model_folder_problem(path: str, field: str, what: str = "model") -> str | None:
    """Why `path` cannot be a Hugging Face model (or tokenizer) folder, or None (hub ids are not looked up)."""
    p = Path(path).expanduser()
    kind = _kind(path)
    if kind == "missing":
        return f"{field}: no {what} folder at {_q(path)}" if _looks_local(path) else None
    if kind != "dir":
        return f"{field}: {_q(path)} is a file; give the {what}'s folder"
    markers = ("tokenizer_config.json", "tokenizer.json", "config.json") if what == "tokenizer" else ("config.json",)
    if not any((p / m).is_file() for m in markers):
        return f"{field}: {_q(path)} has no {' or '.join(markers)}, so it is not a Hugging Face {what} folder"
    return None


def module_names(path: str) -> dict[str, str] | None:
    """{module name: its class name} of the causal LM in the local folder `path`, built on the meta device
    from its config.json (no weights read); None when transformers cannot build it from the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    except Exception:  # noqa: BLE001 - an architecture this transformers cannot build: train will say
        return None
    return {name: type(module).__name__ for name, module in model.named_modules() if name}


def lora_target_problem(model: ModelConfig, notes: list[str]) -> str | None:
    """`model.lora.target_modules` against the model's module names, as peft matches them (a name, or its
    dotted suffix): a problem when none matches (train would refuse after loading the model), a note naming
    those that match nothing beside others that do. Checked for local model folders only."""
    targets = model.lora.target_modules
    if not model.lora.rank or targets == "all-linear" or model_folder_problem(model.path, "model.path"):
        return None
    if _kind(model.path) != "dir":
        return None  # a hub id: not looked up
    names = module_names(model.path)
    if names is None:
        notes.append(f"model.lora.target_modules: not checked (transformers cannot build {_q(model.path)} "
                     "from its config)")
        return None
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched and len(unmatched) == len(targets):
        linear = sorted({n.rsplit(".", 1)[-1] for n, kind in names.items() if kind == "Linear"})
        return (f"model.lora.target_modules: {unmatched} name no module of the model at {_q(model.path)}; its "
                f"linear layers are {linear} (or use 'all-linear')")
    if unmatched:
        notes.append(f"model.lora.target_modules: {unmatched} name no module of the model; only the others are "
                     "adapted")
    return None


# ----------------------------------------------------------------------------------------------- devices


def device_problem(spec: str, field: str = "model.device") -> str | None:
    """Whether the device exists on this machine. The form is checked by the schema; torch is imported only
    for an accelerator (cpu and auto need nothing)."""
    kind, _, index = spec.partition(":")
    if kind in ("auto", "cpu"):
        return None
    import torch  # the only way to know whether an accelerator is there

    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"{field}: {spec!r} but this machine has no CUDA device; use cpu or auto"
        if index and int(index) >= count:
            return f"{field}: {spec!r} but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
        return None
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"{field}: 'mps' but Apple's Metal backend is not available here; use cpu or auto"
    if kind == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return f"{field}: 'xpu' but no Intel GPU is available here; use cpu or auto"
    return None


def tied_embeddings(path: str) -> bool | None:
    """Whether a local model folder's config.json ties its input and output embeddings (None: not a local
    folder, or config.json does not say)."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings"))
    return tied if isinstance(tied, bool) else None


LOOPBACK = ("127.0.0.1", "localhost", "::1")
TIED_ON_VLLM_CPU = ("model.path has tied input and output embeddings, and vLLM on the CPU does not reload a tied "
                    "output head in place: from the first weight push on, its servers would sample with the start-up "
                    "head (the weight probe then stops the run). Train an untied copy of the model "
                    "(docs/vllm.md shows how), or LoRA with engine.sync vllm (adapters only)")


def vllm_head_problem(cfg: RLConfig, notes: list[str]) -> str | None:
    """`engine.sync: vllm` / `vllm_broadcast` reloads full weights into vLLM in place, which on the CPU leaves a
    tied output head stale: refused when the servers are on this machine and it has no GPU, a note when they
    are elsewhere (their platform cannot be known here)."""
    eng = cfg.engine
    if eng.weight_sync not in ("vllm", "vllm_broadcast") or (eng.weight_sync == "vllm" and cfg.model.lora.rank):
        return None
    if not tied_embeddings(cfg.model.path):
        return None
    if all(urlsplit(url).hostname in LOOPBACK for url in eng.urls):
        import torch  # whether vLLM on this machine could run on a GPU

        if not torch.cuda.is_available():
            return f"engine.sync: {eng.weight_sync}: {TIED_ON_VLLM_CPU}"
        return None
    notes.append(f"engine.urls: if these vLLM servers run on the CPU, {TIED_ON_VLLM_CPU}")
    return None


# ----------------------------------------------------------------------------------------------- datasets


def _jsonl_head(p: Path, field: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with p.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{field}: {_q(str(p))} line {number} is not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{field}: {_q(str(p))} line {number} is a {type(row).__name__}, not an object "
                                  "of column values")
            rows.append(row)
            if len(rows) >= HEAD_ROWS:
                break
    return rows


def _json_head(p: Path, field: str) -> list[dict[str, Any]] | None:
    """A .json file is either JSON lines or one array of row objects (None: too large to read here)."""
    with p.open("rb") as f:
        first = f.read(4096).lstrip()[:1]
    if first != b"[":
        return _jsonl_head(p, field)
    if p.stat().st_size > 64 << 20:  # a huge array is left to the dataset reader
        return None
    try:
        rows = json.loads(p.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: {_q(str(p))} is not JSON ({exc})") from None
    if rows and not all(isinstance(r, dict) for r in rows[:HEAD_ROWS]):
        raise ConfigError(f"{field}: {_q(str(p))} must be an array of objects (one per row)")
    return rows[:HEAD_ROWS]


def dataset_columns(path: str, split: str = "train", field: str = "data.path") -> list[str] | None:
    """The columns of a local dataset, read from its first rows (None when they cannot be known without
    loading it, e.g. a hub name). Missing files, empty files and broken first rows are `ConfigError`s."""
    p = Path(path).expanduser()
    kind = _kind(path)
    if kind == "missing":
        if _looks_local(path):
            raise ConfigError(f"{field}: no such file or folder {_q(path)} (a local json/jsonl/csv/parquet file "
                              "or folder, or a hub dataset name such as org/name)")
        return None
    if kind == "dir":
        for info in (p / "dataset_info.json", p / split / "dataset_info.json"):
            if info.is_file():
                features = json.loads(info.read_text()).get("features") or {}
                return list(features) or None
        return None
    if p.suffix not in DATA_SUFFIXES:
        raise ConfigError(f"{field}: unsupported file type {p.suffix!r} ({', '.join(DATA_SUFFIXES)})")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq  # light next to datasets; only for parquet files

        try:
            return list(pq.read_schema(p).names)
        except Exception as exc:  # noqa: BLE001 - a damaged file is a config problem to report
            raise ConfigError(f"{field}: {_q(path)} is not a readable parquet file ({exc})") from None
    if p.suffix == ".csv":
        with p.open(newline="", encoding="utf-8-sig", errors="replace") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise ConfigError(f"{field}: {_q(path)} is empty (no header row)")
        return header
    rows = _jsonl_head(p, field) if p.suffix == ".jsonl" else _json_head(p, field)
    if rows is None:
        return None
    if not rows:
        raise ConfigError(f"{field}: {_q(path)} has no rows")
    return list(dict.fromkeys(k for row in rows for k in row))


def needed_columns(fn: Callable[..., Any], per_sample: bool = False) -> list[str]:
    """Arguments a reward function requires that only a dataset column can fill: parameters without a
    default that are not TRL's own (prompts, completions, ...). per_sample functions get the prompt and the
    completion as their first two arguments."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read: nothing is known to be needed
        return []
    if per_sample:
        params = params[2:]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in REWARD_ARGS]


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _column_problems(cfg: RLConfig, columns: list[str], functions: Iterable[tuple[str, Any, bool]]) -> list[str]:
    from tokenmill.data.formats import rl_prompt_problem  # late, as the task registry (no package cycle)

    shown = ", ".join(columns[:20]) + (", ..." if len(columns) > 20 else "")
    problems = []
    if cfg.env is None and (problem := rl_prompt_problem(columns, cfg.data.prompt_column)):
        problems.append(problem)
    for field, fn, per_sample in functions:
        missing = [c for c in needed_columns(fn, per_sample) if c not in columns]
        if missing:
            problems.append(f"{field}: {_fn_name(fn)}() needs the dataset column(s) {', '.join(map(repr, missing))}, "
                            f"which the dataset lacks (columns: {shown}); add them or give the parameter a default")
    return problems


def _in_memory_columns(dataset: Any) -> list[str] | None:
    """Columns of a `datasets.Dataset`, or of a list of row dicts (its first rows)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return names
    if isinstance(dataset, list) and dataset and all(isinstance(r, dict) for r in dataset[:HEAD_ROWS]):
        return list(dict.fromkeys(k for row in dataset[:HEAD_ROWS] for k in row))
    return None


# ----------------------------------------------------------------------------------------------- the run


def _reads_column(name: str, column: str) -> Callable[..., Any]:
    """A stand-in with the signature of a builtin reward that reads `column` (for the column check)."""
    def reads(**kwargs: Any) -> None:
        return None

    kinds = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD
    reads.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(column, kinds[0]), inspect.Parameter("kwargs", kinds[1])])
    reads.__name__ = name
    return reads


def _reward_functions(cfg: RLConfig, extra: list[Any], problems: list[str]) -> list[tuple[str, Any, bool]]:
    found = []
    for i, rc in enumerate(cfg.rewards):
        if isinstance(rc, RewardFunctionConfig):
            try:
                fn = resolve(rc.function, f"rewards.{i}.function")
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            except (OSError, ValueError) as exc:  # a file name the OS refuses
                problems.append(f"rewards.{i}.function: cannot read {_q(rc.function)}: {type(exc).__name__}")
                continue
            if not callable(fn):
                problems.append(f"rewards.{i}.function: {_q(rc.function)} is not callable")
            else:
                found.append((f"rewards.{i}.function", fn, rc.per_sample))
        elif rc.type == "builtin":
            if importlib.util.find_spec(rc.builtin) is None:  # the builtin is named after its package
                problems.append(f"rewards.{i}.builtin: {rc.builtin} needs the {rc.builtin.replace('_', '-')} "
                                "package: pip install tokenmill[tasks]")
            found.append((f"rewards.{i}.column", _reads_column(rc.builtin, rc.column), False))
        elif isinstance(rc, RewardModelConfig):
            problem = model_folder_problem(rc.path, f"rewards.{i}.path", "reward model")
            if problem is None and _kind(rc.path) == "missing":
                problem = f"rewards.{i}.path: no reward model folder at {_q(rc.path)}"
            if problem:
                problems.append(problem)
    for j, fn in enumerate(extra):
        if not hasattr(fn, "weight"):  # a plain function (a Reward object takes its columns as one dict)
            found.append((f"rewards[{j}] (passed to train)", fn, False))
    return found


def _env_problem(cfg: RLConfig) -> str | None:
    if cfg.env is not None and cfg.env.openenv is not None:
        from tokenmill.envs.openenv import config_problem

        return config_problem(cfg.env.openenv)
    if cfg.env is not None and cfg.env.verifiers is not None:  # loaded as the run will (import, taskset, tasks)
        try:
            from tokenmill.envs.verifiers_env import load_cached

            load_cached(cfg.env.verifiers, cfg.env.kwargs)
        except ConfigError as exc:
            return str(exc)
        return None
    if cfg.env is None or cfg.env.name is None:
        return None
    from tokenmill.envs import BUILTIN_ENVS  # names and import strings only (the classes load when used)

    name = cfg.env.name
    if name in BUILTIN_ENVS:
        return None
    if ":" not in name:
        return (f"env.name: unknown environment {_q(name)}; built-in: {', '.join(BUILTIN_ENVS)}, or "
                "'module:Class' / 'path/to/file.py:Class' of your own")
    try:
        obj = resolve(name, "env.name")
    except ConfigError as exc:
        return str(exc)
    except (OSError, ValueError) as exc:  # a file name the OS refuses
        return f"env.name: cannot read {_q(name)}: {type(exc).__name__}"
    return None if callable(obj) else f"env.name: {_q(name)} names a {type(obj).__name__}, not a class or factory"


def check_model_and_data(model: ModelConfig, data_path: str | None, split: str = "train") -> None:
    """What SFT and preference training share with `check_run`: the model folder, the device, and that a local
    data file exists and its first rows parse. One `ConfigError` with a line per problem."""
    problems = [p for field, path, what in (("model.path", model.path, "model"),
                                            ("model.tokenizer_path", model.tokenizer_path, "tokenizer"))
                if path is not None and (p := model_folder_problem(path, field, what))]
    if problem := device_problem(model.device):
        problems.append(problem)
    if data_path is not None:
        try:
            dataset_columns(data_path, split)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))


def check_run(cfg: RLConfig, rewards: list[Any] | None = None, dataset: Any = None) -> list[str]:
    """Check what a run needs besides a valid config, loading no model: raise one `ConfigError` with a line per
    problem. Returns notes on what could not be checked here (a hub model or dataset is not looked up)."""
    problems: list[str] = []
    notes: list[str] = []
    for field, path, what in (("model.path", cfg.model.path, "model"),
                              ("model.tokenizer_path", cfg.model.tokenizer_path, "tokenizer"),
                              ("critic.path", cfg.critic.path if cfg.algorithm.advantage == "gae" else None, "critic")):
        if path is not None and (problem := model_folder_problem(path, field, what)):
            problems.append(problem)
        elif path is not None and _kind(path) == "missing":
            notes.append(f"{field} {_q(path)} is taken as a hub id (not looked up)")
    if problem := device_problem(cfg.model.device):
        problems.append(problem)
    if problem := _env_problem(cfg):
        problems.append(problem)
    if problem := vllm_head_problem(cfg, notes):
        problems.append(problem)
    if problem := lora_target_problem(cfg.model, notes):
        problems.append(problem)
    functions = _reward_functions(cfg, list(rewards or []), problems)
    columns: list[str] | None = None
    try:
        if dataset is not None:
            columns = _in_memory_columns(dataset)
        elif cfg.data.path is not None:
            columns = dataset_columns(cfg.data.path, cfg.data.split)
            if columns is None:
                notes.append(f"data.path {_q(cfg.data.path)}: columns not checked (not a local file)")
    except ConfigError as exc:
        problems.append(str(exc))
    if columns is not None:
        problems.extend(_column_problems(cfg, columns, functions))
    if cfg.data.eval_path is not None:  # held-out rows are scored by the same rewards: the same columns
        try:
            held = dataset_columns(cfg.data.eval_path, cfg.data.split, field="data.eval_path")
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            problems.extend(f"data.eval_path: {p}" for p in _column_problems(cfg, held, functions) if held is not None)
    if problems:
        raise ConfigError("\n".join(problems))
    return notes
