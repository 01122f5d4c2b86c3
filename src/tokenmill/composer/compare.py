"""Reading runs side by side: the curves of 2-4 runs on one axis per metric and the config keys that differ;
a run's name and tags (labels.json in its folder); its efficiency report (report.json).

Everything is read from the run folders, like the rest of the Runs page: a run from `tokenmill train` that
the Composer never launched compares as well as one it did.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from tokenmill.composer.runs import FILES, LABELS, RunError, RunManager

MAX_COMPARED = 4
MAX_POINTS = 2000  # per run and metric: longer curves are thinned evenly (the last point is kept)
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:=+-]{0,31}$")
# shown first when a run has them: RL's reward, held-out accuracy, KL and entropy; SFT / preference losses
PREFERRED = ("reward/mean", "eval/accuracy", "kl", "entropy", "loss", "accuracy", "margin", "eval/loss")


def set_labels(runs: RunManager, run_id: str, name: str | None, tags: list[str]) -> dict[str, Any]:
    """Name and tag a run (kept in its folder's labels.json); RunError 422 names a bad tag."""
    folder = runs.folder(run_id)
    bad = [t for t in tags if not _TAG.match(t)]
    if bad:
        raise RunError(422, f"tags: {bad[0]!r} is not a tag (letters, digits and _.:=+-, at most 32 characters)")
    name = (name or "").strip() or None
    if name is not None and len(name) > 80:
        raise RunError(422, f"name: at most 80 characters (got {len(name)})")
    tmp = folder / (LABELS + ".tmp")
    tmp.write_text(json.dumps({"name": name, "tags": list(dict.fromkeys(tags))}))
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


def _curves(folder: Path) -> dict[str, list[list[float]]]:
    """Every numeric metric of metrics.jsonl as [step, value] pairs (rows without a step are skipped)."""
    curves: dict[str, list[list[float]]] = {}
    try:
        lines = (folder / FILES["metrics"]).read_text(errors="replace").splitlines()
    except OSError:
        return curves
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            continue
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                curves.setdefault(key, []).append([row["step"], value])
    for key, points in curves.items():
        if len(points) > MAX_POINTS:
            stride = len(points) / MAX_POINTS
            curves[key] = [points[int(i * stride)] for i in range(MAX_POINTS - 1)] + [points[-1]]
    return curves


def compare(runs: RunManager, ids: list[str]) -> dict[str, Any]:
    """2-4 runs: each one's description and curves, the metrics they share (the preferred ones first), and
    the config keys that differ."""
    ids = list(dict.fromkeys(ids))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise RunError(400, f"ids: compare 2 to {MAX_COMPARED} runs (got {len(ids)})")
    folders = {rid: runs.folder(rid) for rid in ids}
    curves = {rid: _curves(folder) for rid, folder in folders.items()}
    keys = set.union(*(set(c) for c in curves.values()))
    shared = [k for k in keys if sum(k in c for c in curves.values()) >= 2]
    ordered = [k for k in PREFERRED if k in shared] + sorted(k for k in shared if k not in PREFERRED)
    return {
        "runs": [{**runs.describe(rid), "curves": curves[rid]} for rid in ids],
        "metrics": ordered,
        "config_diff": config_diff({rid: _config(folder) for rid, folder in folders.items()}),
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
