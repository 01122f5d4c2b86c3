"""The run's logger: metrics.jsonl and samples.jsonl always, plus its trackers (`tracking/base.py`): a rich
progress bar or plain lines on the console, TensorBoard, W&B, trackio and MLflow when asked. RL, SFT,
preference and reward-model runs all log through it, so their rows have the same keys (`offline_row`)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tokenmill.tracking import events
from tokenmill.tracking.base import Tracker, numeric
from tokenmill.tracking.stages import StageTimer

SUMMARY_KEYS = [
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
    ("margin", "margin", "{:.3f}"),
    ("entropy", "ent", "{:.3f}"),
    ("response_len/mean", "len", "{:.1f}"),
    ("timing_s/step", "s", "{:.2f}"),
    ("throughput/e2e_tok_s", "tok/s", "{:.0f}"),
]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ConsoleTracker:
    """A rich progress bar with a one-line summary (on a terminal), plain summary lines every `log_every`
    steps, or nothing (`mode` "none")."""

    def __init__(self, total_steps: int, mode: str = "rich", log_every: int = 1, label: str = "GRPO") -> None:
        self.mode = mode if sys.stdout.isatty() or mode != "rich" else "plain"
        self.total, self.log_every = total_steps, log_every
        self._progress = self._task = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[summary]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, summary="")
            self._progress.start()

    def summary(self, step: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total}"]
        for key, short, fmt in SUMMARY_KEYS:
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{short} {fmt.format(metrics[key])}")
        if "bottleneck" in metrics:
            parts.append(f"slowest {metrics['bottleneck']}")
        return " | ".join(parts)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        line = self.summary(step, metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, summary=line.split(" | ", 1)[-1])
        elif self.mode == "plain" and (step % self.log_every == 0 or step == self.total):
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class TensorBoardTracker:
    """Scalars under `output_dir/tensorboard` (needs tensorboard)."""

    def __init__(self, output_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in numeric(metrics).items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (needs wandb) with the run's config."""

    def __init__(self, output_dir: Path, project: str, run_config: dict[str, Any] | None) -> None:
        import wandb

        self.run = wandb.init(project=project, dir=str(output_dir), config=run_config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """What the loop logs through: `log` (a step's metrics), `log_samples`, `message` (a console line), `close`."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        console: str = "rich",
        log_every: int = 1,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "tokenmill",
        run_config: dict[str, Any] | None = None,
        trackers: list[Tracker] | None = None,
        trackio: bool = False,
        mlflow: bool = False,
        label: str = "GRPO",
    ) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.samples_file = open(self.dir / "samples.jsonl", "a", buffering=1)  # noqa: SIM115
        self.events = events.EventLog(self.dir / events.FILENAME)  # stage entries, for live views
        events.activate(self.events)
        self.console = ConsoleTracker(total_steps, console, log_every, label)
        self.trackers: list[Tracker] = [self.console]
        if tensorboard:
            self.trackers.append(TensorBoardTracker(self.dir))
        if wandb:
            self.trackers.append(WandbTracker(self.dir, wandb_project, run_config))
        if trackio or mlflow:
            from tokenmill.tracking.sinks import MlflowTracker, TrackioTracker

            if trackio:  # `wandb_project` names the project on every dashboard
                self.trackers.append(TrackioTracker(wandb_project, self.dir.name, run_config))
            if mlflow:
                self.trackers.append(MlflowTracker(self.dir, wandb_project, self.dir.name, run_config))
        self.trackers += trackers or []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.samples_file.write(json.dumps({"step": step, **r}) + "\n")

    def message(self, text: str) -> None:
        self.console.message(text)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        events.deactivate(self.events)
        self.events.close()
        self.metrics_file.close()
        self.samples_file.close()


def offline_row(metrics: dict[str, Any], timer: StageTimer) -> dict[str, Any]:
    """The metrics row of one SFT, preference or reward-model step: its training metrics (tensors as floats:
    loss, margin, accuracy, lr, grad_norm), its stage timings and its tokens/s, under the keys an RL step uses."""
    row: dict[str, Any] = {k: float(v) for k, v in metrics.items()}
    row |= timer.report()
    row["throughput/e2e_tok_s"] = timer.tokens.get("train", 0) / max(float(row["timing_s/step"]), 1e-9)
    return row
