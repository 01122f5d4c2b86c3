"""The one offline training loop: SFT, DPO / IPO / SimPO and reward models all step through `run_offline`.

An offline objective is two things: `batches`, what each step trains on (`sampled_batches` draws them from a
fixed pool), and `loss_fn(batch) -> (loss, metrics)`, which runs the forward and backward passes of one batch
(the gradients end in the model). The loop times the step, takes the optimiser step and writes the metrics
row. The objectives live beside their data: `training.sft` (token NLL on samples) and `training.preference`
(pairwise losses).

    backend, _ = offline_trainer(model, optim, steps)          # seeded; FSDP2 ranks under torchrun
    losses = run_offline(backend, sampled_batches(pool, 32, optim.seed), loss_fn, steps, logger)
    finish(backend, model, tokenizer, output_dir)               # the trained weights, exported

A new offline objective is a `loss_fn` (and its pool) in its own module, run through these three calls.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from tokenmill.checkpoint.export import export_model
from tokenmill.checkpoint.preempt import DEFAULT_TIMEOUT_S, Preempted, Preemption
from tokenmill.config.health import SkippedUpdateAlarm
from tokenmill.config.load import load_config
from tokenmill.config.offline import OfflineConfig
from tokenmill.config.schema import OptimConfig
from tokenmill.health.alarms import AlarmStop, SkippedUpdates, announce
from tokenmill.tracking.logger import MetricsLogger, offline_row
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.training.dist import is_main, max_over_ranks
from tokenmill.training.sharded import copy_back, offline_backend
from tokenmill.training.spec import TrainerSpec

T = TypeVar("T")
LossFn = Callable[[list[Any]], tuple[float, dict[str, Any]]]


def optim_settings(mode: type[OfflineConfig], given: dict[str, Any]) -> OptimConfig:
    """The optimiser of an offline run from keyword arguments (`learning_rate=`, `warmup_steps=`, ...): the
    `OptimConfig` fields `given` names, `mode`'s defaults (an `SFTConfig`'s, a `PreferenceConfig`'s) for the
    rest; a `ConfigError` naming a field that is not an optimiser field or out of bounds."""
    defaults = {name: mode.model_fields[name].default for name in OptimConfig.model_fields}
    return load_config(OptimConfig, {**defaults, **given})


def offline_trainer(model: torch.nn.Module, optim: OptimConfig, steps: int, **backend: Any) -> tuple[Any, torch.nn.Module]:
    """(backend, module to run forward passes on) with `optim`'s optimiser over `steps` steps, after seeding
    torch with `optim.seed`: the one place an offline run builds its backend. `backend` adds `LocalBackend`
    keywords (micro-batching, packing)."""
    torch.manual_seed(optim.seed)
    spec = TrainerSpec(
        learning_rate=optim.learning_rate, total_steps=steps, weight_decay=optim.weight_decay,
        betas=tuple(optim.betas), warmup_steps=optim.warmup_steps, lr_schedule=optim.lr_schedule,
        max_grad_norm=optim.max_grad_norm, track_entropy=False, **backend,
    )
    return offline_backend(model, spec)


def sampled_batches(pool: Sequence[T], batch_size: int, seed: int) -> Iterator[list[T]]:
    """Endless batches of `batch_size` items of `pool`, each drawn without replacement (all of a smaller pool),
    in an order fixed by `seed`. `pool` may be a `datasets.Dataset` (its rows are read once)."""
    rng = random.Random(seed)
    items = [pool[i] for i in range(len(pool))]
    while True:
        yield rng.sample(items, min(batch_size, len(items)))


def run_offline(
    backend: Any, batches: Iterator[list[T]], loss_fn: LossFn, steps: int, logger: MetricsLogger | None = None,
    *, tokens: Callable[[list[T]], int] | None = None, log_every: int = 0, label: str = "offline",
    skipped_update: SkippedUpdateAlarm | None = None, export: Callable[[], Path | None] | None = None,
) -> list[float]:
    """`steps` optimiser steps, one batch of `batches` each; return the loss of each step. `loss_fn(batch)`
    leaves the batch's gradients in the model and returns (loss, metrics). With a `logger`, each step writes
    the same metrics row as an RL step (the metrics, lr, grad norm, timings, tokens/s of `tokens(batch)`);
    without one, the main rank prints a line every `log_every` steps. A step whose gradient was NaN or inf is
    not applied by the backend (`skipped_nonfinite`): it is an `alarm` event in events.jsonl and a console line,
    and `skipped_update.window` such steps in a row (default 3) raise `AlarmStop` (`health.alarms`).

    SIGTERM or Ctrl-C stops the loop at the end of the step (`checkpoint.preempt`): `export()` writes the model
    as trained so far and returns where, and `Preempted` (exit status 75) says so. An offline run keeps no
    checkpoint to resume from: rerun it to train all its steps."""
    losses = []
    skips = SkippedUpdates(skipped_update)
    with Preemption(DEFAULT_TIMEOUT_S, steps=steps, agree=max_over_ranks, field=None) as preempt:
        for step, batch in zip(range(1, steps + 1), batches, strict=False):
            counted = tokens(batch) if tokens is not None and logger is not None else 0
            with step_timer(step) as timer, stage("train", tokens=counted):
                loss, metrics = loss_fn(batch)
                metrics |= backend.optim_step()
            losses.append(loss)
            skipped = skips.check(step, metrics)  # a NaN or inf gradient was not applied: say so, stop after N
            if skipped is not None:
                announce(skipped, say=lambda line: print(line, flush=True))
                if skipped.policy == "stop":
                    raise AlarmStop(skipped)
            if logger is not None:
                logger.log(step, offline_row(metrics, timer))
            elif log_every and step % log_every == 0 and is_main():
                print(f"{label} step {step}/{steps} loss {loss:.4f}", flush=True)
            if step < steps and preempt.stop_now(step):
                _stop(preempt, step, steps, label, export)
    return losses


def _stop(preempt: Preemption, step: int, steps: int, label: str, export: Callable[[], Path | None] | None) -> None:
    """Write what the offline run has (`export`) and raise `Preempted` saying where."""
    where = export() if export is not None else None
    preempt.saved_path = where
    saved = f"the model as trained so far written to {where}" if where else "nothing written (no output_dir)"
    raise Preempted(f"{label} stopped by {preempt.stop_signal} after step {step} of {steps}: {saved}; an offline "
                    f"run keeps no checkpoint: rerun it to train all {steps} steps (exit status 75)",
                    signal_name=preempt.stop_signal or "", step=step, path=where)


def finish(backend: Any, model: torch.nn.Module, tokenizer: Any, output_dir: str | Path | None) -> Path | None:
    """After the loop: `model` holds the trained weights (gathered from the ranks under torchrun) and, with an
    `output_dir`, the main rank writes it there as a Hugging Face folder (returned)."""
    copy_back(backend, model)
    if output_dir is not None and is_main():
        export_model(model, tokenizer, Path(output_dir))
        return Path(output_dir)
    return None
