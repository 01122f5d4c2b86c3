"""The one offline loop: seeded batches, one optimiser step per batch with the schedule the config asks for,
per-step losses returned and logged as RL rows. A least-squares fit on a linear layer stands in for a model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill.config import OptimConfig, PreferenceConfig, SFTConfig
from tokenmill.tracking import MetricsLogger
from tokenmill.training.offline import offline_trainer, optim_settings, run_offline, sampled_batches
from tokenmill.types import ConfigError


def test_batches_are_seeded_draws_without_replacement():
    pool = list(range(10))
    first = [b for _, b in zip(range(5), sampled_batches(pool, 4, seed=3), strict=False)]
    again = [b for _, b in zip(range(5), sampled_batches(pool, 4, seed=3), strict=False)]
    other = [b for _, b in zip(range(5), sampled_batches(pool, 4, seed=4), strict=False)]
    assert first == again and first != other
    assert all(len(b) == len(set(b)) == 4 and set(b) <= set(pool) for b in first)
    assert sorted(next(sampled_batches(pool[:3], 8, seed=0))) == [0, 1, 2]  # a small pool: all of it


def _fit(steps: int, optim: OptimConfig, logger=None) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(32, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3
    backend, module = offline_trainer(model, optim, steps)

    def loss_fn(rows: list[int]) -> tuple[float, dict[str, float]]:
        loss = torch.nn.functional.mse_loss(module(x[rows]), y[rows])
        loss.backward()
        return loss.item(), {"loss": loss.item()}

    return run_offline(backend, sampled_batches(range(32), 8, optim.seed), loss_fn, steps, logger,
                       tokens=len)


def test_the_loop_fits_and_follows_the_schedule(tmp_path):
    optim = OptimConfig(learning_rate=0.1, warmup_steps=2, lr_schedule="cosine")
    logger = MetricsLogger(tmp_path, 6, console="none")
    try:
        losses = _fit(6, optim, logger)
    finally:
        logger.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["loss"] for r in rows] == pytest.approx(losses)
    cosine = [0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in range(2, 6)]
    assert [r["lr"] for r in rows] == pytest.approx([0.1 * f for f in [0.5, 1.0, *cosine]])
    assert all(r["grad_norm"] > 0 and r["bottleneck"] == "train" for r in rows)
    assert rows[0]["throughput/train_tok_s"] * rows[0]["timing_s/train"] == pytest.approx(8)  # `tokens` per batch
    longer = _fit(60, OptimConfig(learning_rate=0.1))
    assert sum(longer[-5:]) < 0.05 * sum(longer[:5])
    assert _fit(6, optim) == losses  # seeded: the same run twice is the same numbers


def test_keyword_settings_take_the_modes_defaults_and_refuse_other_keys():
    assert optim_settings(SFTConfig, {"seed": 4}).model_dump() == {
        "learning_rate": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999), "warmup_steps": 20,
        "lr_schedule": "cosine", "max_grad_norm": 1.0, "seed": 4}
    assert optim_settings(PreferenceConfig, {}).learning_rate == 2e-5
    with pytest.raises(ConfigError, match="^learning_rat: unknown field; did you mean learning_rate\\?$"):
        optim_settings(SFTConfig, {"learning_rat": 1e-3})


def test_a_nan_step_is_skipped_named_in_events_and_three_in_a_row_stop(tmp_path):
    """SFT / preference step through `run_offline`: a NaN gradient never reaches the weights; each such step is
    an `alarm` event naming the cause, and the third in a row stops the run with the weights of the last good
    step."""
    from tokenmill.config.health import SkippedUpdateAlarm
    from tokenmill.health.alarms import AlarmStop

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    backend, module = offline_trainer(model, OptimConfig(learning_rate=0.1), 10)
    poisoned = {2, 4, 5, 6}  # step 3 is good again: the count restarts

    def loss_fn(step: list[int]) -> tuple[float, dict[str, float]]:
        loss = torch.nn.functional.mse_loss(module(x), y) * (math.nan if step[0] in poisoned else 1.0)
        loss.backward()
        return loss.item(), {"loss": loss.item()}

    seen: dict[int, torch.Tensor] = {}

    def steps():
        for s in range(1, 11):
            seen[s] = module.weight.detach().clone()
            yield [s]

    logger = MetricsLogger(tmp_path, 10, console="none")
    try:
        with pytest.raises(AlarmStop, match=r"step 6 skipped its update: loss was NaN.*3 in a row: the run stops"):
            run_offline(backend, steps(), loss_fn, 10, logger, skipped_update=SkippedUpdateAlarm(window=3))
    finally:
        logger.close()
    assert torch.equal(seen[3], seen[2]) and not torch.equal(seen[4], seen[3])  # 2 skipped, 3 applied
    assert torch.equal(module.weight.detach(), seen[4])  # steps 4, 5, 6 changed nothing
    assert torch.isfinite(module.weight).all()
    alarms = [json.loads(r) for r in (tmp_path / "events.jsonl").read_text().splitlines()]
    alarms = [r for r in alarms if r["event"] == "alarm"]
    assert [(r["step"], r["name"], r["policy"], r["value"]) for r in alarms] == [
        (2, "skipped_update", "warn", 1.0), (4, "skipped_update", "warn", 1.0), (5, "skipped_update", "warn", 2.0),
        (6, "skipped_update", "stop", 3.0)]
