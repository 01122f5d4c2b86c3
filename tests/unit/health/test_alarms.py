"""Each alarm on a synthetic metric stream: it fires at the threshold and the window, not a step before; a
warning keeps the run going (one console line, one `alarm` row in events.jsonl); a stop saves a checkpoint
first and raises with the message; NaN stops without a checkpoint."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.config.health import AlarmsConfig
from tokenmill.health.alarms import Alarms, AlarmStop
from tokenmill.rewards.watch import RewardFailureError
from tokenmill.tracking import MetricsLogger
from tokenmill.types import Group, Sample, StopReason

ALL_OFF = {name: {"policy": "off"} for name in AlarmsConfig.model_fields}


def _alarms(name: str, lines: list[str] | None = None, saved: list[int] | None = None, hints=None, **settings):
    cfg = AlarmsConfig(**(ALL_OFF | {name: settings}))
    return Alarms(cfg, say=(lines if lines is not None else []).append,
                  save=(saved if saved is not None else []).append, hints=hints)


def _stream(alarms: Alarms, rows: list[dict], groups=()) -> list[tuple[int, str]]:
    """(step, alarm name) of everything fired while feeding `rows` as steps 1, 2, ..."""
    return [(step, f.name) for step, row in enumerate(rows, start=1) for f in alarms.check(step, row, groups)]


def _sample(reward: float, rewards=None, errors=None, advantage: float = 0.0) -> Sample:
    return Sample(tokens=(1, 2), loss_mask=(0, 1), logprobs=(0.0, -1.0), prompt_len=1, prompt="p", completion="c",
                  stop_reason=StopReason.STOP, version=0, group_id=0, reward=reward, rewards=rewards or {},
                  reward_errors=errors or {}, advantage=advantage)


def test_flat_groups_fires_at_the_fifth_flat_step_once_and_names_the_fix():
    lines: list[str] = []
    alarms = _alarms("flat_groups", lines, policy="warn", threshold=1.0, window=5)
    groups = [Group(i, (_sample(1.0), _sample(1.0))) for i in range(16)]
    rows = [{"groups/zero_variance_fraction": v} for v in [1.0, 1.0, 0.5, 1, 1, 1, 1, 1, 1, 1]]
    # steps 4-8 are the first five flat steps in a row; it stays quiet while the groups stay flat
    assert _stream(alarms, rows, groups) == [(8, "flat_groups")]
    assert lines == [
        ("alarm (warn) flat_groups: all 16 groups scored the same for 5 steps (groups/zero_variance_fraction 1 >= "
        "threshold 1): no advantage, nothing to learn; the task is too hard or too easy for this policy; raise "
        "generation.group_size, use algorithm.dynamic_sampling, or check the reward")]
    # it re-arms once the groups have spread again
    assert _stream(alarms, [{"groups/zero_variance_fraction": 0.0}] + [{"groups/zero_variance_fraction": 1.0}] * 5,
                   groups)[-1:] == [(6, "flat_groups")]


def test_flat_groups_is_no_alarm_when_a_teacher_sets_the_advantages():
    # on-policy distillation: the per-token reverse KL is the signal, equal rewards take nothing from it
    alarms = _alarms("flat_groups", policy="warn", threshold=1.0, window=2, hints={"distillation": True})
    assert _stream(alarms, [{"groups/zero_variance_fraction": 1.0}] * 4) == []


def test_truncation_fires_at_the_threshold_not_below_it():
    alarms = _alarms("truncation", hints={"max_tokens": 1}, policy="warn", threshold=0.5, window=2)
    rows = [{"response_len/clip_ratio": v} for v in [0.49, 0.5, 0.49, 0.5, 0.5]]
    assert _stream(alarms, rows) == [(5, "truncation")]
    assert alarms.fired[0].value == 0.5 and alarms.fired[0].threshold == 0.5
    assert alarms.fired[0].message.startswith("50% of completions were cut at generation.max_tokens (1) for 2 steps")


def test_entropy_floor_and_entropy_drop():
    floor = _alarms("entropy_floor", policy="warn", threshold=0.1, window=3)
    assert _stream(floor, [{"entropy": v} for v in [0.2, 0.09, 0.1, 0.09, 0.05, 0.01]]) == [(6, "entropy_floor")]
    drop = _alarms("entropy_drop", policy="warn", threshold=0.5, window=3)
    # 2.0 -> 1.0 over 3 steps is exactly a 50% fall: fires at step 4, not at step 3 (1.2 vs 2.0: 40%)
    assert _stream(drop, [{"entropy": v} for v in [2.0, 1.8, 1.2, 1.0, 0.9]]) == [(4, "entropy_drop")]
    assert "entropy fell 50% in 3 steps (2 -> 1; threshold 50%)" in drop.fired[0].message


def test_grad_spike_against_the_running_median():
    alarms = _alarms("grad_spike", policy="warn", threshold=10.0, window=3)
    # no median before three steps of history (step 1's 50 is no spike); step 5: median(1, 2, 3) = 2, 19.9 < 20
    assert _stream(alarms, [{"grad_norm": v} for v in [50.0, 1.0, 2.0, 3.0, 19.9]]) == []
    # step 6: median(2, 3, 19.9) = 3, and 30 is exactly 10x
    assert alarms.check(6, {"grad_norm": 30.0})[0].message.startswith(
        "grad_norm 30 is 10.0x the median 3 of the last 3 steps (threshold 10x)")


def test_reward_plateau_compares_two_windows_and_only_warns():
    alarms = _alarms("reward_plateau", policy="warn", threshold=0.0, window=2)
    rising = [0.1, 0.2, 0.3, 0.4]
    assert _stream(alarms, [{"reward/mean": v} for v in rising]) == []
    flat = _alarms("reward_plateau", policy="warn", threshold=0.0, window=2)
    assert _stream(flat, [{"reward/mean": v} for v in [0.5, 0.3, 0.4, 0.4]]) == [(4, "reward_plateau")]
    with pytest.raises(ValueError, match="reward_plateau.policy"):
        AlarmsConfig(reward_plateau={"policy": "stop"})


def test_mismatch_names_the_temperature():
    alarms = _alarms("mismatch", hints={"temperature": 1.0, "engine_temperature": 0.5},
                     policy="warn", threshold=0.01, window=2)
    rows = [{"mismatch/kl": v, "mismatch/mean_abs": 0.3} for v in [0.02, 0.005, 0.01, 0.2]]
    assert _stream(alarms, rows) == [(4, "mismatch")]
    assert ("likely causes: the engine samples at temperature 0.5 but the trainer assumes generation.temperature 1"
            in alarms.fired[0].message)
    assert "mismatch/kl 0.2 >= threshold 0.01, mismatch/mean_abs 0.3" in alarms.fired[0].message
    unknown = _alarms("mismatch", hints={"temperature": 0.7}, policy="warn", threshold=0.01, window=1)
    assert "a temperature other than generation.temperature (0.7)" in unknown.check(1, {"mismatch/kl": 1.0})[0].message


def test_probe_failure_stops_after_saving_a_checkpoint():
    saved: list[int] = []
    alarms = _alarms("probe", saved=saved, policy="stop", threshold=1.0, window=1)
    assert alarms.check(1, {"probe/ok": 1.0}) == [] and alarms.check(2, {}) == []  # no probe this step
    with pytest.raises(AlarmStop, match=r"^the engine did not score the probe .* \(probe/ok 0 < threshold 1, "
                                        r"probe/max_abs 2.5\)") as err:
        alarms.check(3, {"probe/ok": 0.0, "probe/max_abs": 2.5})
    assert saved == [3] and err.value.fired.step == 3 and err.value.fired.policy == "stop"


def test_reward_failures_keep_the_watch_behaviour_per_function():
    fail = [Group(0, (_sample(math.nan, {"a": None, "b": 1.0}, {"a": "KeyError: 'x'"}),))]
    half = [Group(0, (_sample(1.0, {"a": 1.0}), _sample(math.nan, {"a": None}, {"a": "E"})))]
    saved: list[int] = []
    said: list[str] = []
    alarms = _alarms("reward_failures", lines=said, saved=saved, policy="stop", threshold=1.0, window=2)
    assert alarms.check(1, {}, fail) == [] and alarms.check(2, {}, half) == [] and alarms.check(3, {}, fail) == []
    with pytest.raises(RewardFailureError, match=r"^reward 'a' failed on every sample in 2 consecutive steps \(3-4\); "
                                                 r"first error: KeyError: 'x'\. Fix or remove the function"):
        alarms.check(4, {}, fail)
    assert saved == [4]
    assert said == []  # the raise carries the stop line: whoever catches it prints it, once
    lower = _alarms("reward_failures", lines=said, policy="warn", threshold=0.5, window=1)
    assert [f.metric for f in lower.check(1, {}, half)] == ["reward/a/failed"]
    assert len(said) == 1 and said[0].startswith("alarm (warn) reward_failures: reward 'a' failed on 50%")
    assert "failed on 50% of its samples (threshold 50%)" in lower.fired[0].message


@pytest.mark.parametrize("metrics, groups, key", [
    ({"loss": math.nan}, (), "loss"),
    ({"loss": 0.1, "grad_norm": math.inf}, (), "grad_norm"),
    ({"loss": 0.1}, [Group(0, (_sample(1.0, advantage=math.nan),))], "advantage"),
])
def test_nan_or_inf_always_stops_and_saves_nothing(metrics, groups, key):
    saved: list[int] = []
    alarms = Alarms(AlarmsConfig(**ALL_OFF), save=saved.append, say=lambda _: None)
    with pytest.raises(AlarmStop, match=rf"^{key} is (NaN|inf) at step 7: .*no checkpoint of these weights"):
        alarms.check(7, metrics, groups)
    assert saved == []


def test_warn_writes_an_alarm_event_row_and_the_run_goes_on(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, console="none")
    try:
        alarms = _alarms("truncation", policy="warn", threshold=0.5, window=1)
        for step in (1, 2, 3):
            alarms.check(step, {"response_len/clip_ratio": 1.0 if step == 2 else 0.0})
    finally:
        logger.close()
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    alarm_rows = [r for r in rows if r["event"] == "alarm"]
    assert len(alarm_rows) == 1
    row = alarm_rows[0]
    assert {k: row[k] for k in ("name", "metric", "value", "threshold", "policy", "step")} == {
        "name": "truncation", "metric": "response_len/clip_ratio", "value": 1.0, "threshold": 0.5,
        "policy": "warn", "step": 2}
    assert row["message"].startswith("100% of completions were cut")


def test_off_alarms_never_fire_and_defaults_are_the_documented_ones():
    alarms = Alarms(AlarmsConfig(**ALL_OFF), say=lambda _: None)
    row = {"groups/zero_variance_fraction": 1.0, "response_len/clip_ratio": 1.0, "entropy": 0.0,
           "mismatch/kl": 9.0, "probe/ok": 0.0, "reward/mean": 0.0, "grad_norm": 1.0}
    assert _stream(alarms, [row] * 300) == []
    d = AlarmsConfig()
    assert (d.flat_groups.policy, d.flat_groups.threshold, d.flat_groups.window) == ("warn", 1.0, 5)
    assert (d.reward_failures.policy, d.probe.policy, d.reward_plateau.policy) == ("stop", "stop", "warn")


def test_a_skipped_update_warns_naming_the_cause_and_stops_after_the_window(tmp_path):
    """The trainer skipped the update (`skipped_nonfinite`), so the NaN loss is no immediate stop: each such
    step is a warning naming it, `window` in a row stop, and an applied step in between restarts the count."""
    said: list[str] = []
    saved: list[int] = []
    alarms = _alarms("skipped_update", lines=said, saved=saved, policy="stop", window=2)
    skipped = {"loss": math.nan, "grad_norm": math.nan, "skipped_nonfinite": 1.0}
    assert _stream(alarms, [skipped, {"loss": 0.5, "grad_norm": 1.0}]) == [(1, "skipped_update")]
    assert said == [("alarm (warn) skipped_update: step 1 skipped its update: loss was NaN, so the gradient was "
                     "not applied (1 in a row; the run stops at 2); lower training.learning_rate, look for NaN or "
                     "extreme rewards or inputs, and train in float32 if the model is in half precision")]
    assert [f.name for f in alarms.check(3, {**skipped, "skipped_nonfinite": 0.5})] == ["skipped_update"]
    assert "skipped 50% of its optimiser steps" in alarms.fired[-1].message
    with pytest.raises(AlarmStop, match=r"^step 4 skipped its update: grad_norm was inf, .*2 in a row: the run stops"):
        alarms.check(4, {"loss": 0.5, "grad_norm": math.inf, "skipped_nonfinite": 1.0})
    assert saved == []  # the weights were never touched: the last checkpoint stands
    critic = _alarms("skipped_update", policy="stop", window=3)
    fired = critic.check(1, {"loss": 0.1, "critic/grad_norm": math.nan, "critic/skipped_nonfinite": 1.0})
    assert [f.name for f in fired] == ["skipped_update"] and "critic/grad_norm was NaN" in fired[0].message
    warn_only = _alarms("skipped_update", policy="warn", window=1)
    assert _stream(warn_only, [skipped] * 3) == [(1, "skipped_update"), (2, "skipped_update"), (3, "skipped_update")]
    assert AlarmsConfig().skipped_update.policy == "stop" and AlarmsConfig().skipped_update.window == 3
    with pytest.raises(AlarmStop, match="^loss is NaN"):  # without the trainer's skip it is the old immediate stop
        _alarms("skipped_update", policy="warn").check(1, {"loss": math.nan})
