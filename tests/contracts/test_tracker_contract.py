"""The `Tracker` contract (tracking/base.py), run against every tracker that ships.

A tracker takes each step's metrics as the loop gives them (floats and ints, a NaN where a metric is
undefined, a few strings such as `bottleneck`) without raising, records the numbers of each step it keeps,
and is closed once. Each entry says where to read back what it recorded.

Adding a tracker is one entry in `TRACKERS`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokenmill.tracking.base import Tracker
from tokenmill.tracking.logger import ConsoleTracker, MetricsLogger

STEPS = {
    0: {"eval/accuracy": 0.25},
    1: {"reward/mean": 0.5, "kl": float("nan"), "train/optimizer_steps": 1, "bottleneck": "train"},
    2: {"reward/mean": 0.75, "kl": 0.01, "train/optimizer_steps": 1, "bottleneck": "generate"},
}


@dataclass(frozen=True)
class TrackerSpec:
    make: Callable[[Path], Tracker]
    # (folder, captured stdout) -> {step: {metric: value}} of the numbers it recorded
    read: Callable[[Path, str], dict[int, dict[str, float]]]
    needs: str | None = None  # an optional package


def read_metrics_jsonl(folder: Path, _: str) -> dict[int, dict[str, float]]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r.pop("step"): {k: v for k, v in r.items() if isinstance(v, (int, float))} for r in records}


def read_plain_lines(_: Path, out: str) -> dict[int, dict[str, float]]:
    """`step 2/2 | reward 0.750 | kl 0.0100 | slowest generate` -> {2: {"reward/mean": 0.75, "kl": 0.01}}"""
    short = {"reward": "reward/mean", "eval_acc": "eval/accuracy", "kl": "kl"}
    got = {}
    for line in out.splitlines():
        head, *parts = line.split(" | ")
        step = int(head.split()[1].split("/")[0])
        got[step] = {short[k]: float(v) for k, v in (p.split(" ", 1) for p in parts) if k in short}
    return got


def read_tensorboard(folder: Path, _: str) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    return got


def tensorboard(folder: Path) -> Tracker:
    from tokenmill.tracking.logger import TensorBoardTracker

    return TensorBoardTracker(folder)


def trackio(folder: Path) -> Tracker:
    from tokenmill.tracking.sinks import TrackioTracker

    # trackio reads $TRACKIO_DIR once, when first imported: keep the test runs out of the user's cache
    os.environ.setdefault("TRACKIO_DIR", str(folder.parent / "trackio"))
    return TrackioTracker(project=f"contract-{folder.name}", name="run")


def read_trackio(folder: Path, _: str) -> dict[int, dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(f"contract-{folder.name}", "run")
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp")} for r in rows}


def mlflow(folder: Path) -> Tracker:
    from tokenmill.tracking.sinks import MlflowTracker

    return MlflowTracker(folder, "contract", name="run", run_config={"model": {"path": "m"}, "steps": 2})


def read_mlflow(folder: Path, _: str) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("contract").experiment_id])[0]
    assert run.data.params == {"model.path": "m", "steps": "2"}
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    return got


TRACKERS = {
    "console-plain": TrackerSpec(lambda _: ConsoleTracker(2, mode="plain"), read_plain_lines),
    "console-none": TrackerSpec(lambda _: ConsoleTracker(2, mode="none"), lambda _, out: {} if not out else None),
    "metrics-logger": TrackerSpec(lambda folder: MetricsLogger(folder, 2, console="none"), read_metrics_jsonl),
    "tensorboard": TrackerSpec(tensorboard, read_tensorboard, needs="tensorboard"),
    "trackio": TrackerSpec(trackio, read_trackio, needs="trackio"),
    "mlflow": TrackerSpec(mlflow, read_mlflow, needs="mlflow"),
}


def finite_numbers(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_tracker_records_each_steps_numbers(name, tmp_path, capsys):
    spec = TRACKERS[name]
    if spec.needs:
        pytest.importorskip(spec.needs, reason=f"the {name} tracker needs {spec.needs}")
    tracker = spec.make(tmp_path)
    assert isinstance(tracker, Tracker)
    for step, metrics in STEPS.items():
        tracker.log(step, dict(metrics))
    tracker.close()
    got = spec.read(tmp_path, capsys.readouterr().out)
    assert got is not None, f"{name} printed although it should not"
    for step, numbers in got.items():
        expected = finite_numbers(STEPS[step])
        assert set(numbers) <= set(expected) | {k for k, v in STEPS[step].items() if isinstance(v, float)}
        for key, value in numbers.items():
            if value is not None and key in expected:
                assert value == pytest.approx(expected[key], rel=1e-3), (step, key)
    if name in ("metrics-logger", "tensorboard", "trackio", "mlflow"):  # the sinks that keep every number
        assert sorted(got) == sorted(STEPS)
        for step, metrics in STEPS.items():
            kept = {k: v for k, v in got[step].items() if v is not None}
            assert kept == pytest.approx(finite_numbers(metrics), rel=1e-6)
