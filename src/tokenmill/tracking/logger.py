"""Metric sinks: JSONL always, a rich progress bar or plain lines, TensorBoard and W&B when asked."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tokenmill.tracking import events

SUMMARY_KEYS = [
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
    ("entropy", "ent", "{:.3f}"),
    ("response_len/mean", "len", "{:.1f}"),
    ("timing_s/step", "s", "{:.2f}"),
    ("throughput/e2e_tok_s", "tok/s", "{:.0f}"),
]


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
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
    ) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(self.dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self.samples_file = open(self.dir / "samples.jsonl", "a", buffering=1)  # noqa: SIM115
        self.events = events.EventLog(self.dir / events.FILENAME)  # stage entries, for live views
        events.activate(self.events)
        self.console = console if sys.stdout.isatty() or console != "rich" else "plain"
        self.log_every = log_every
        self.total = total_steps
        self._progress = self._task = None
        if self.console == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[summary]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, summary="")
            self._progress.start()
        self._tb = self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        if wandb:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(project=wandb_project, dir=str(self.dir), config=run_config)

    def summary(self, step: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total}"]
        for key, short, fmt in SUMMARY_KEYS:
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{short} {fmt.format(metrics[key])}")
        if "bottleneck" in metrics:
            parts.append(f"slowest {metrics['bottleneck']}")
        return " | ".join(parts)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        line = self.summary(step, metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, summary=line.split(" | ", 1)[-1])
        elif self.console == "plain" and (step % self.log_every == 0 or step == self.total):
            print(line, flush=True)

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        for r in records:
            self.samples_file.write(json.dumps({"step": step, **r}) + "\n")

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        elif self.console != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        events.deactivate(self.events)
        self.events.close()
        self.metrics_file.close()
        self.samples_file.close()
