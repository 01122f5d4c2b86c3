"""Trackers for dashboards beyond TensorBoard and W&B, each through its own package: trackio (local SQLite
under `$TRACKIO_DIR`, viewed with `trackio show`) and MLflow (the server at `$MLFLOW_TRACKING_URI`, else a
local store in the run folder, viewed with `mlflow ui`)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from tokenmill.tracking.base import numeric

MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")  # the characters MLflow accepts in a metric name


class TrackioTracker:
    """A trackio run (needs trackio; `pip install tokenmill[trackio]`) with the run's config."""

    def __init__(self, project: str, name: str | None = None, run_config: dict[str, Any] | None = None) -> None:
        import trackio

        self.run = trackio.init(project=project, name=name, config=run_config, auto_log_cpu=False,
                                auto_log_gpu=False)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run (needs mlflow or mlflow-skinny; `pip install tokenmill[mlflow]`) in `experiment`, with the
    run's config as parameters. Metric names keep their slashes; other characters MLflow refuses become `_`."""

    def __init__(self, output_dir: Path, experiment: str, name: str | None = None,
                 run_config: dict[str, Any] | None = None, tracking_uri: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:  # a local store beside metrics.jsonl (MLflow keeps its file store behind this flag)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(output_dir).resolve() / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        if run_config:
            from mlflow.entities import Param

            flat = _flatten(run_config)
            params = [Param(k[:250], str(v)[:6000]) for k, v in flat.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(MLFLOW_KEY.sub("_", k), v, now, step) for k, v in numeric(metrics).items()]
        for i in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = MLFLOW_KEY.sub("_", f"{prefix}{k}")
        if isinstance(v, dict):
            out |= _flatten(v, f"{key}.")
        else:
            out[key] = v
    return out
