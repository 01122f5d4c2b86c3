"""Reading runs side by side: the curves of 2-4 runs on one axis per metric and the config keys that differ;
a run's name and tags (labels.json in its folder); its efficiency report (report.json).

Everything is read from the run folders, like the rest of the Runs page: a run from `tokenmill train` that
the Composer never launched compares as well as one it did.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from tokenmill.composer import configs
from tokenmill.composer.runs import FILES, LABELS, RunError, RunManager

MAX_COMPARED = 4
MAX_POINTS = 2000  # per run and metric: longer curves are thinned evenly (the last point is kept)
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=+-]{0,31}$")
# shown first when a run has them: RL's reward, held-out accuracy, KL and entropy; SFT / preference losses
PREFERRED = ("reward/mean", "eval/accuracy", "kl", "entropy", "loss", "accuracy", "margin", "eval/loss")


def set_labels(runs: RunManager, run_id: str, name: str | None, tags: list[str], *,
               archived: bool | None = None) -> dict[str, Any]:
    """Name, tag and archive a run (kept in its folder's labels.json; `archived` None keeps what it was);
    RunError 422 names a bad tag."""
    folder = runs.folder(run_id)
    bad = [t for t in tags if not _TAG.match(t)]
    if bad:
        raise RunError(422, f"tags: {bad[0]!r} is not a tag (letters, digits and _.:=+-, at most 32 characters)")
    name = (name or "").strip() or None
    if name is not None and len(name) > 80:
        raise RunError(422, f"name: at most 80 characters (got {len(name)})")
    tmp = folder / (LABELS + ".tmp")
    if archived is None:
        try:
            archived = bool(json.loads((folder / LABELS).read_text()).get("archived", False))
        except (OSError, ValueError, AttributeError):
            archived = False
    kept = {"name": name, "tags": list(dict.fromkeys(tags))} | ({"archived": True} if archived else {})
    tmp.write_text(json.dumps(kept))
    os.replace(tmp, folder / LABELS)
    return runs.describe(run_id)


def _config(folder: Path) -> dict[str, Any]:
    for name in ("run.yaml", "config.yaml"):
        try:
            tree = yaml.safe_load((folder / name).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(tree, dict):
            return tree
    return {}


def run_config(folder: Path) -> dict[str, Any]:
    """The run's config as written (run.yaml, or a `tokenmill train` folder's config.yaml); {} when unreadable."""
    return _config(folder)


def effective_config(folder: Path, mode: str) -> dict[str, Any]:
    """The run's config with every default filled in (what the run used: `generation.group_size: 4` where
    the YAML left it out), its rewards keyed by name with their code by content (`_rewards_by_content`);
    the YAML as written when it does not validate."""
    tree = _config(folder)
    tree.pop("mode", None)
    cfg, _ = configs.validate(mode, tree) if mode in configs.MODES else (None, [])
    full = configs.normalized(cfg) if cfg is not None else tree
    if isinstance(full.get("rewards"), list):
        full["rewards"] = _rewards_by_content(folder, full["rewards"])
    return full


def _reward_code(folder: Path, function: str) -> tuple[str, str] | None:
    """(file name, source) of a `file.py:function` reward, the file found as given or in the run folder."""
    head, sep, _ = function.rpartition(":")
    if not sep or not head.endswith(".py"):
        return None
    for path in (Path(head), folder / head, folder / "rewards" / Path(head).name):
        try:
            return path.name, path.read_text(errors="replace")
        except OSError:
            continue
    return None


def _rewards_by_content(folder: Path, rewards: list[Any]) -> dict[str, Any]:
    """{name: entry}: a code reward's `function` as `<file name>:<function>` and its source's sha256 under
    `code` (byte-identical code in two run folders compares equal; where it lives does not count)."""
    out: dict[str, Any] = {}
    for i, entry in enumerate(rewards):
        if not isinstance(entry, dict):
            out[str(i)] = entry
            continue
        entry = dict(entry)
        found = _reward_code(folder, str(entry.get("function") or ""))
        if found is not None:
            entry["function"] = f"{found[0]}:{str(entry['function']).rpartition(':')[2]}"
            entry["code"] = "sha256:" + hashlib.sha256(found[1].encode()).hexdigest()[:16]
        out[str(entry.get("name") or i)] = entry
    return out


def reward_code_diffs(folders: dict[str, Path], trees: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per reward whose code differs between the runs: each run's source, and a unified diff of each other run's
    source against the first run's."""
    sources: dict[str, dict[str, str | None]] = {}
    for rid in trees:
        raw = _config(folders[rid]).get("rewards")
        for entry in raw if isinstance(raw, list) else []:
            if isinstance(entry, dict) and entry.get("name"):
                found = _reward_code(folders[rid], str(entry.get("function") or ""))
                sources.setdefault(str(entry["name"]), {})[rid] = found[1] if found else None
    out = []
    for name, by_run in sorted(sources.items()):
        codes = [by_run.get(rid) for rid in trees]
        if len(set(codes)) <= 1:
            continue
        first_id = next(iter(trees))
        first = by_run.get(first_id) or ""
        diffs = {rid: "".join(difflib.unified_diff(first.splitlines(True), (by_run.get(rid) or "").splitlines(True),
                                                   f"{first_id}/{name}", f"{rid}/{name}"))
                 for rid in trees if rid != first_id}
        out.append({"name": name, "code": {rid: by_run.get(rid) for rid in trees}, "diff": diffs})
    return out


@functools.lru_cache(maxsize=1024)
def _flat_config_cached(folder: Path, mode: str, mtime_ns: int) -> dict[str, Any]:
    return _flat(effective_config(folder, mode))


def config_columns(runs: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Each run with `columns`: the effective value of each dotted config key (defaults filled in, as in the
    comparison; None where the run has no such key). Read once per version of its run.yaml."""
    for run in runs:
        folder = Path(run["output_dir"])
        path = folder / "run.yaml" if (folder / "run.yaml").exists() else folder / "config.yaml"
        try:
            flat = _flat_config_cached(folder, run["mode"], path.stat().st_mtime_ns)
        except OSError:
            flat = {}
        run["columns"] = {key: flat.get(key) for key in keys}
    return runs


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


# where a launched run's files go differs per run by construction: not a difference worth listing
_OWN_PATHS = ("tracking.output_dir", "output_dir")


def config_diff(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The dotted keys whose values differ between the runs' configs (a key one run lacks counts), each with
    every run's value (None where absent), in key order."""
    flat = {rid: _flat(tree) for rid, tree in configs.items()}
    keys = sorted({k for f in flat.values() for k in f} - set(_OWN_PATHS))
    out = []
    for key in keys:
        values = {rid: f.get(key) for rid, f in flat.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            out.append({"path": key, "values": values})
    return out


def _rows(folder: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows that have a step (a torn or foreign line is skipped)."""
    try:
        lines = (folder / FILES["metrics"]).read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def _thin(points: list[list[float]]) -> list[list[float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = len(points) / MAX_POINTS
    return [points[int(i * stride)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _curves(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Every numeric metric of the rows as [step, value] pairs."""
    curves: dict[str, list[list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                curves.setdefault(key, []).append([row["step"], value])
    return {key: _thin(points) for key, points in curves.items()}


def _axes(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Other x-axes than the step, as [step, x] pairs: `wall_s`, the seconds of training up to the end of each
    step (the sum of `timing_s/step`), and `tokens`, the tokens processed up to it (the sum of each step's
    `throughput/e2e_tok_s` x `timing_s/step`). A run that logs no step time has neither."""
    wall = tokens = 0.0
    out: dict[str, list[list[float]]] = {"wall_s": [], "tokens": []}
    for row in rows:
        seconds = row.get("timing_s/step")
        if not isinstance(seconds, (int, float)):
            continue
        wall += seconds
        out["wall_s"].append([row["step"], round(wall, 6)])
        rate = row.get("throughput/e2e_tok_s")
        if isinstance(rate, (int, float)):
            tokens += rate * seconds
            out["tokens"].append([row["step"], round(tokens, 3)])
    return {key: _thin(points) for key, points in out.items() if points}


def compare(runs: RunManager, ids: list[str]) -> dict[str, Any]:
    """2-4 runs: each one's description and curves, the metrics they share (the preferred ones first), and
    the config keys that differ."""
    ids = list(dict.fromkeys(ids))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise RunError(400, f"ids: compare 2 to {MAX_COMPARED} runs (got {len(ids)})")
    folders = {rid: runs.folder(rid) for rid in ids}
    described = {rid: runs.describe(rid) for rid in ids}
    rows = {rid: _rows(folder) for rid, folder in folders.items()}
    curves = {rid: _curves(r) for rid, r in rows.items()}
    keys = set.union(*(set(c) for c in curves.values()))
    shared = [k for k in keys if sum(k in c for c in curves.values()) >= 2]
    ordered = [k for k in PREFERRED if k in shared] + sorted(k for k in shared if k not in PREFERRED)
    trees = {rid: effective_config(folder, described[rid]["mode"]) for rid, folder in folders.items()}
    return {
        "runs": [{**described[rid], "curves": curves[rid], "axes": _axes(rows[rid])} for rid in ids],
        "metrics": ordered,
        "constant": sorted(k for k in shared if _constant(curves, k)),
        "config_diff": config_diff(trees),
        "reward_code": reward_code_diffs(folders, trees),
    }


def _constant(curves: dict[str, dict[str, list[list[float]]]], key: str) -> bool:
    """A metric with one value over every step of every run (a learning rate without schedule, a config echo):
    nothing to compare."""
    return len({v for c in curves.values() for _, v in c.get(key, [])}) <= 1


def clone(runs: RunManager, run_id: str) -> dict[str, Any]:
    """What Compose needs to start from a run: `{"mode", "config", "rewards"}`, the config as the run was
    launched without its own output folder, and the rewards written in the page (the files in the run's
    `rewards/` folder) back as page rewards `{"name", "function", "code", "weight", "timeout_s"}` instead of
    references to that folder."""
    folder = runs.folder(run_id)
    mode = runs.describe(run_id)["mode"]
    tree = _config(folder)
    tree.pop("mode", None)
    tree.pop("output_dir", None)
    if isinstance(tree.get("tracking"), dict):
        tree["tracking"] = {k: v for k, v in tree["tracking"].items() if k != "output_dir"}
    page, kept = [], []
    own = (folder / "rewards").resolve()
    for entry in tree.get("rewards") or []:
        head, _, function = str(entry.get("function", "")).rpartition(":") if isinstance(entry, dict) else ("", "", "")
        path = Path(head) if head else None
        if path is not None and path.suffix == ".py" and path.resolve().parent == own and path.is_file():
            page.append({"name": entry.get("name") or path.stem, "function": function, "code": path.read_text(),
                         "weight": entry.get("weight", 1.0), "timeout_s": entry.get("timeout_s", 10.0)})
        else:
            kept.append(entry)
    if "rewards" in tree:
        tree["rewards"] = kept
    return {"mode": mode, "config": tree, "rewards": page}


MAX_SHARED_PROMPTS = 50
MAX_COMPLETIONS = 8  # per run and prompt: its latest


def _samples(folder: Path) -> list[dict[str, Any]]:
    try:
        lines = (folder / FILES["samples"]).read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append(row)
    return out


def shared_samples(runs: RunManager, ids: list[str], prompt: str | None = None) -> dict[str, Any]:
    """The prompts that 2-4 runs' samples.jsonl share (the most recently sampled first), and for `prompt` (the
    first shared one when None) each run's latest completions of it with their step, reward and advantage."""
    ids = list(dict.fromkeys(ids))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise RunError(400, f"ids: compare 2 to {MAX_COMPARED} runs (got {len(ids)})")
    samples = {rid: _samples(runs.folder(rid)) for rid in ids}
    last_seen: dict[str, int] = {}
    for rows in samples.values():
        for i, row in enumerate(rows):
            last_seen[row["prompt"]] = max(last_seen.get(row["prompt"], -1), i)
    shared = [p for p in last_seen if all(any(r["prompt"] == p for r in rows) for rows in samples.values())]
    shared.sort(key=lambda p: -last_seen[p])
    chosen = prompt if prompt is not None else (shared[0] if shared else None)
    keep = ("step", "completion", "reward", "advantage", "stop", "rewards")
    return {
        "prompts": shared[:MAX_SHARED_PROMPTS], "prompt": chosen,
        "completions": {rid: [{k: r[k] for k in keep if k in r} for r in rows if r["prompt"] == chosen][-MAX_COMPLETIONS:]
                        for rid, rows in samples.items()},
    }


def efficiency_report(runs: RunManager, run_id: str) -> dict[str, Any]:
    """`{"report": <the run's report.json>}`, the trainer's efficiency report; `{"report": null}` while it
    has none (not a 404: the page asks as soon as the report's events.jsonl row arrives, and a browser logs
    every failed request as a console error)."""
    path = runs.folder(run_id) / "report.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return {"report": None}
    except (OSError, ValueError) as exc:
        raise RunError(422, f"run {run_id!r}: report.json is not JSON ({exc})") from None
    return {"report": report}
