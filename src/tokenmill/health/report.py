"""The efficiency report: how long a step took against its ideal, where the time went, and the one change
that would help most.

Every step logs `efficiency/*` (live in the Composer and the trackers); at the end of the run the mean over
the steps (the first one, which warms up, left out when there are others) is printed, appended to
events.jsonl as `{"event": "efficiency_report", ...}` and written to `report.json` in the run folder. A run
that restarted (a Ray trainer group rebuilt, an engine replica replaced: `restart` rows in events.jsonl) lists
them under `restarts`.

The ideal step: generation and training one after the other when they take turns (colocated, sync), their
maximum when generation runs beside training (async: the producer thread or servers). Where the time went:
`generate`, `reward`, `train` (the policy update, the critic and reference passes), `sync` (the weight push)
and `idle` (the trainer waiting for rollouts, logging, evaluation, checkpoints). In an async run `generate`
and `reward` are the producer's seconds, which overlap the trainer's step.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.tracking import events

PARTS = ("generate", "reward", "train", "sync", "idle")
NOT_TRAIN = {"step", "generate", "reward", "sync", "wait"}  # every other timed stage is training work


def _f(metrics: dict[str, Any], key: str) -> float:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) else 0.0


def efficiency_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """`efficiency/*` of one step from its `timing_s/*` (and, async, `async/producer_*_s`) metrics; empty
    when the step was not timed."""
    step = _f(metrics, "timing_s/step")
    if step <= 0:
        return {}
    overlapped = any(k.startswith("async/producer_") for k in metrics)
    src = "async/producer_{}_s" if overlapped else "timing_s/{}"
    generate, reward = _f(metrics, src.format("generate")), _f(metrics, src.format("reward"))
    train = sum(_f(metrics, k) for k in metrics
                if k.startswith("timing_s/") and k.removeprefix("timing_s/") not in NOT_TRAIN)
    sync = _f(metrics, "timing_s/sync")
    if overlapped:  # the trainer's step: train, sync and waiting for the producer
        ideal = max(generate + reward, train)
        idle = max(0.0, step - train - sync)
    else:
        ideal = generate + reward + train
        idle = max(0.0, step - generate - reward - train - sync)
    seconds = {"generate": generate, "reward": reward, "train": train, "sync": sync, "idle": idle}
    out = {"efficiency/ideal_s": ideal, "efficiency/ratio": min(1.0, ideal / step),
           "efficiency/async": float(overlapped)}
    out |= {f"efficiency/share/{k}": v / step for k, v in seconds.items()}
    return out


def advice(shares: dict[str, float], overlapped: bool, occupancy: float | None = None) -> str:
    """The one change that would help most, from where the time went (shares of the step)."""
    top = max(PARTS, key=lambda k: shares.get(k, 0.0))
    pct = f"{shares.get(top, 0.0):.0%}"
    if overlapped and top == "idle":
        return (f"the trainer waits for rollouts {pct} of the step: generation is the bottleneck; add engines "
                "(engine.num_servers), raise controller.max_staleness so the producer runs further ahead, or "
                "lower generation.max_tokens")
    if top == "generate":
        occupied = f" and the engine batch is {occupancy:.0%} occupied" if occupancy is not None else ""
        text = (f"generation is {pct} of the step{occupied}: raise controller.prompts_per_step or "
                "env.max_concurrent so each engine batch holds more sequences")
        if not overlapped:
            text += ", or generate beside training (engine.placement: thread) so the two overlap"
        return text
    return {
        "reward": f"reward scoring is {pct} of the step: make the reward function cheaper (cache, batch it) or "
                  "give a model reward a faster device",
        "train": f"training is {pct} of the step: raise training.micro_batch_tokens if memory allows, train "
                 "LoRA adapters (model.lora.rank), or lower algorithm.ppo_epochs",
        "sync": f"the weight sync is {pct} of the step: train LoRA adapters (only they are sent) or use a "
                "faster engine.sync",
        "idle": f"{pct} of the step is outside generate / reward / train / sync (evaluation, checkpoints, "
                "logging): raise controller.eval_every or checkpoint.every",
    }[top]


class EfficiencyReport:
    """Collects each step's metrics; `finish` writes the run's report (console line, event row, report.json)."""

    def __init__(self, output_dir: str | Path | None = None, say: Callable[[str], None] = print) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.say = say
        self.rows: list[dict[str, Any]] = []

    def add(self, metrics: dict[str, Any]) -> None:
        if "efficiency/ideal_s" in metrics:
            self.rows.append(metrics)

    def after_step(self, step: int, metrics: dict[str, Any], groups=()) -> None:  # the `Monitors` hook
        self.add(metrics)

    def summary(self) -> dict[str, Any] | None:
        """The mean step, its ideal, the shares, and the advice; None before any timed step."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        if not rows:
            return None
        mean = {k: statistics.fmean(_f(r, k) for r in rows) for k in rows[0]
                if k.startswith(("efficiency/", "timing_s/")) or k == "agent/batch_occupancy"}
        step = mean.get("timing_s/step", 0.0)
        shares = {p: mean.get(f"efficiency/share/{p}", 0.0) for p in PARTS}
        overlapped = mean.get("efficiency/async", 0.0) > 0.5
        return {
            "steps": len(rows), "mode": "async" if overlapped else "sync",
            "step_s": step, "ideal_s": mean.get("efficiency/ideal_s", 0.0),
            "efficiency": mean.get("efficiency/ratio", 0.0),
            "seconds": {p: shares[p] * step for p in PARTS}, "shares": shares,
            "advice": advice(shares, overlapped, mean.get("agent/batch_occupancy")),
        }

    def finish(self) -> dict[str, Any] | None:
        report = self.summary()
        if report is None:
            return None
        where = " | ".join(f"{p} {report['shares'][p]:.0%}" for p in PARTS)
        self.say(f"efficiency: step {report['step_s']:.3g} s vs ideal {report['ideal_s']:.3g} s "
                 f"({report['efficiency']:.0%}, {report['mode']}); {where}. Most would help: {report['advice']}")
        restarts = restart_rows(self.output_dir)
        if restarts:  # the run went on after a failure: the report says so, not only the console
            report["restarts"] = restarts
            counts = Counter(str(r.get("role", "unknown")) for r in restarts)
            self.say("restarts: " + ", ".join(f"{n} {role}" for role, n in counts.items()) + " (events.jsonl)")
        events.emit("efficiency_report", **report)
        if self.output_dir is not None:
            (self.output_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report


def restart_rows(output_dir: Path | None) -> list[dict[str, Any]]:
    """The `restart` rows of the run's events.jsonl (a trainer group rebuilt, an engine replica replaced), in
    order, without their `event` key; empty without a folder or a file."""
    path = output_dir / events.FILENAME if output_dir is not None else None
    if path is None or not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if isinstance(row, dict) and row.get("event") == "restart":
            rows.append({k: v for k, v in row.items() if k != "event"})
    return rows
