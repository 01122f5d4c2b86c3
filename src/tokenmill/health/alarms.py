"""Health alarms: read each step's metrics and say, in one line, when the run cannot learn and why.

Each alarm of `health.alarms` watches one metric against a threshold over a window of steps and has a
policy: `warn` prints the message and appends an `alarm` row to events.jsonl (the Composer shows it as a
banner), `stop` appends the row, writes a checkpoint and raises `AlarmStop` with the message (printed once,
by whoever catches it: the CLI prints it and exits with status 1), `off` skips it. A warning fires once when its condition has held for `window` steps
and again only after the condition has cleared. An update the trainer skipped for a NaN or inf gradient
(`skipped_nonfinite`) is a `skipped_update` alarm each step, and stops after its `window` in a row; NaN or inf
in the loss, the gradient norm or the advantages of an update that was applied always stops, without a
checkpoint of the broken weights (the last one written is kept).

    >>> alarms = Alarms(AlarmsConfig(), say=print)                                          # doctest: +SKIP
    >>> alarms.check(step, metrics, groups)   # after the step's metrics are logged           # doctest: +SKIP
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.config.health import AlarmsConfig, SkippedUpdateAlarm
from tokenmill.rewards.watch import RewardFailureError, RewardFailureWatch
from tokenmill.tracking import events
from tokenmill.types import Group, TokenmillError

NON_FINITE_KEYS = ("loss", "grad_norm", "value_loss", "critic/loss", "critic/value_loss", "critic/grad_norm")


@dataclass(frozen=True)
class Fired:
    """One alarm firing: the `alarm` row of events.jsonl is `{"event": "alarm", **asdict(fired)}`."""

    name: str
    metric: str
    value: float
    threshold: float
    policy: str
    message: str
    step: int


class AlarmStop(TokenmillError):
    """An alarm with policy `stop` fired (or NaN/inf reached the update); the message says which and the fix."""

    def __init__(self, fired: Fired) -> None:
        super().__init__(fired.message)
        self.fired = fired


class RewardFailureStop(AlarmStop, RewardFailureError):
    """The reward_failures alarm stopped the run (also a `rewards.RewardFailureError`)."""


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _Streak:
    """Counts consecutive steps a condition held; `due` once per run of `window` steps (then re-arms on a
    step the condition is false). Steps without the metric neither count nor reset."""

    def __init__(self, window: int) -> None:
        self.window, self.count, self.fired = window, 0, False

    def due(self, held: bool) -> bool:
        if not held:
            self.count, self.fired = 0, False
            return False
        self.count += 1
        if self.count >= self.window and not self.fired:
            self.fired = True
            return True
        return False


class Alarms:
    """The run's alarms. `say`: the console line; `save(step)`: the checkpoint a `stop` writes first;
    `hints`: run settings the messages quote (`group_size`, `max_tokens`, `temperature`, `engine_temperature`), and
    `distillation` (true: a teacher sets the advantages, so flat groups are no alarm)."""

    def __init__(self, cfg: AlarmsConfig, *, say: Callable[[str], None] = print,
                 save: Callable[[int], None] | None = None, hints: dict[str, Any] | None = None) -> None:
        self.cfg, self.say, self.save, self.hints = cfg, say, save, hints or {}
        names = ("flat_groups", "truncation", "entropy_floor", "mismatch", "probe")
        self._streaks = {n: _Streak(getattr(cfg, n).window) for n in names}
        self._entropy: deque[float] = deque(maxlen=cfg.entropy_drop.window + 1)
        self._grad: deque[float] = deque(maxlen=cfg.grad_spike.window)
        self._reward: deque[float] = deque(maxlen=2 * cfg.reward_plateau.window)
        self._rewards = RewardFailureWatch(cfg.reward_failures.window, cfg.reward_failures.threshold)
        self.skips = SkippedUpdates(cfg.skipped_update)
        self.fired: list[Fired] = []  # every alarm of the run, in order

    def check(self, step: int, metrics: dict[str, Any], groups: Sequence[Group] = ()) -> list[Fired]:
        """The alarms this step fires (each already written to events.jsonl, a warning printed too); raises
        `AlarmStop` after a `stop` alarm, having saved a checkpoint (none for NaN/inf)."""
        skipped = self.skips.check(step, metrics)
        if skipped is not None:
            self._announce(skipped)
            if skipped.policy == "stop":
                raise AlarmStop(skipped)
        broken = None if skipped is not None else self._non_finite(step, metrics, groups)
        if broken is not None:
            self._announce(broken)
            raise AlarmStop(broken)
        found: list[Fired] = []  # a skipped update's warning was announced above: it is returned, not again
        for name, watch in self._watches():
            if getattr(self.cfg, name).policy != "off":
                found += [f for f in watch(step, metrics, groups) if f is not None]
        for fired in found:
            self._announce(fired)
        stops = [f for f in found if f.policy == "stop"]
        if stops:
            if self.save is not None:
                self.save(step)
            first = stops[0]
            raise (RewardFailureStop if first.name == "reward_failures" else AlarmStop)(first)
        return ([skipped] if skipped is not None else []) + found

    after_step = check  # the `Monitors` hook

    def _announce(self, fired: Fired) -> None:
        self.fired.append(fired)
        announce(fired, self.say)

    def _fired(self, name: str, metric: str, value: float, threshold: float, message: str, step: int) -> Fired:
        policy = getattr(self.cfg, name).policy if name != "non_finite" else "stop"
        return Fired(name, metric, value, threshold, policy, message, step)

    def _watches(self):
        return [("flat_groups", self._flat_groups), ("truncation", self._truncation),
                ("entropy_floor", self._entropy_floor), ("entropy_drop", self._entropy_drop),
                ("reward_failures", self._reward_failures), ("mismatch", self._mismatch), ("probe", self._probe),
                ("grad_spike", self._grad_spike), ("reward_plateau", self._reward_plateau)]

    def _streak(self, name: str, value: float | None, held: bool) -> bool:
        return value is not None and math.isfinite(value) and self._streaks[name].due(held)

    # ------------------------------------------------------------------------------------------- the alarms

    def _non_finite(self, step: int, metrics: dict[str, Any], groups: Sequence[Group]) -> Fired | None:
        for key in NON_FINITE_KEYS:
            value = _num(metrics.get(key))
            if value is not None and not math.isfinite(value):
                return self._fired("non_finite", key, value, math.inf, _non_finite_message(key, value, step), step)
        for g in groups:
            for s in g.samples:
                if s.trainable and not all(math.isfinite(a) for a in (s.advantage, *s.token_advantages)):
                    bad = next(a for a in (s.advantage, *s.token_advantages) if not math.isfinite(a))
                    return self._fired("non_finite", "advantage", bad, math.inf,
                                       _non_finite_message("advantage", bad, step), step)
        return None

    def _flat_groups(self, step, metrics, groups) -> list[Fired | None]:
        cfg, key = self.cfg.flat_groups, "groups/zero_variance_fraction"
        if self.hints.get("distillation"):  # the teacher gives every token a signal, whatever the rewards
            return []
        value = _num(metrics.get(key))
        if not self._streak("flat_groups", value, value is not None and value >= cfg.threshold):
            return []
        n = len(groups) or "the"
        who = f"all {n} groups" if value >= 1.0 else f"{value:.0%} of the {n} groups"
        return [self._fired("flat_groups", key, value, cfg.threshold, (
            f"{who} scored the same for {cfg.window} steps ({key} {value:.3g} >= threshold {cfg.threshold:g}): "
            "no advantage, nothing to learn; the task is too hard or too easy for this policy; raise "
            "generation.group_size, use algorithm.dynamic_sampling, or check the reward"), step)]

    def _truncation(self, step, metrics, groups) -> list[Fired | None]:
        cfg, key = self.cfg.truncation, "response_len/clip_ratio"
        value = _num(metrics.get(key))
        if not self._streak("truncation", value, value is not None and value >= cfg.threshold):
            return []
        limit = f" ({self.hints['max_tokens']})" if "max_tokens" in self.hints else ""
        return [self._fired("truncation", key, value, cfg.threshold, (
            f"{value:.0%} of completions were cut at generation.max_tokens{limit} for {cfg.window} steps ({key} "
            f"{value:.3g} >= threshold {cfg.threshold:g}): the rewards see unfinished answers; raise "
            "generation.max_tokens, ask for shorter answers in the prompt, or shape with algorithm.overlong_buffer"),
            step)]

    def _entropy_floor(self, step, metrics, groups) -> list[Fired | None]:
        cfg = self.cfg.entropy_floor
        value = _num(metrics.get("entropy"))
        if not self._streak("entropy_floor", value, value is not None and value < cfg.threshold):
            return []
        return [self._fired("entropy_floor", "entropy", value, cfg.threshold, (
            f"entropy {value:.3g} below the floor {cfg.threshold:g} for {cfg.window} steps: the policy has "
            f"collapsed onto one answer and no longer explores; {ENTROPY_FIX}"), step)]

    def _entropy_drop(self, step, metrics, groups) -> list[Fired | None]:
        cfg = self.cfg.entropy_drop
        value = _num(metrics.get("entropy"))
        if value is None or not math.isfinite(value):
            return []
        self._entropy.append(value)
        if len(self._entropy) <= cfg.window or self._entropy[0] <= 0:
            return []
        first = self._entropy[0]
        drop = (first - value) / first
        if drop < cfg.threshold:
            return []
        self._entropy.clear()  # the next warning needs a fresh window
        self._entropy.append(value)
        return [self._fired("entropy_drop", "entropy", value, cfg.threshold, (
            f"entropy fell {drop:.0%} in {cfg.window} steps ({first:.3g} -> {value:.3g}; threshold "
            f"{cfg.threshold:.0%}): the policy is collapsing; {ENTROPY_FIX}"), step)]

    def _reward_failures(self, step, metrics, groups) -> list[Fired | None]:
        cfg = self.cfg.reward_failures
        return [self._fired("reward_failures", f"reward/{f.name}/failed", f.share, cfg.threshold, f.message, step)
                for f in self._rewards.failing(step, groups)]

    def _mismatch(self, step, metrics, groups) -> list[Fired | None]:
        cfg, key = self.cfg.mismatch, "mismatch/kl"
        value = _num(metrics.get(key))
        if not self._streak("mismatch", value, value is not None and value >= cfg.threshold):
            return []
        extra = "".join(f", {k} {metrics[k]:.3g}" for k in ("mismatch/mean_abs", "mismatch/out_of_range_frac")
                        if _num(metrics.get(k)) is not None)
        return [self._fired("mismatch", key, value, cfg.threshold, (
            f"the engine's logprobs disagree with the trainer's for {cfg.window} steps ({key} {value:.3g} >= "
            f"threshold {cfg.threshold:g}{extra}), so the importance ratios are wrong; likely causes: "
            f"{self._mismatch_causes()}"), step)]

    def _mismatch_causes(self) -> str:
        trainer, engine = self.hints.get("temperature"), self.hints.get("engine_temperature")
        if trainer is not None and engine is not None and not math.isclose(trainer, engine):
            first = (f"the engine samples at temperature {engine:g} but the trainer assumes generation.temperature "
                     f"{trainer:g}: make them equal")
        else:
            at = f" ({trainer:g})" if trainer is not None else ""
            first = f"the engine samples at a temperature other than generation.temperature{at}"
        return (f"{first}; the engine runs in lower precision (bf16) than the trainer; or the weight sync does not "
                "reach the engine (see probe/ok)")

    def _probe(self, step, metrics, groups) -> list[Fired | None]:
        cfg, key = self.cfg.probe, "probe/ok"
        value = _num(metrics.get(key))
        if not self._streak("probe", value, value is not None and value < cfg.threshold):
            return []
        gap = _num(metrics.get("probe/max_abs"))
        seen = f", probe/max_abs {gap:.3g}" if gap is not None else ""
        return [self._fired("probe", key, value, cfg.threshold, (
            f"the engine did not score the probe sequence like the trainer after the weight push ({key} "
            f"{value:g} < threshold {cfg.threshold:g}{seen}): the push did not arrive (a sync that did nothing, an "
            "adapter never loaded); check engine.sync and the engine's log"), step)]

    def _grad_spike(self, step, metrics, groups) -> list[Fired | None]:
        cfg = self.cfg.grad_spike
        value = _num(metrics.get("grad_norm"))
        if value is None or not math.isfinite(value):
            return []
        median = statistics.median(self._grad) if len(self._grad) == cfg.window else None
        self._grad.append(value)
        if median is None or median <= 0 or value < cfg.threshold * median:
            return []
        return [self._fired("grad_spike", "grad_norm", value, cfg.threshold, (
            f"grad_norm {value:.3g} is {value / median:.1f}x the median {median:.3g} of the last {cfg.window} "
            f"steps (threshold {cfg.threshold:g}x): an unstable update; lower training.learning_rate, keep "
            "training.max_grad_norm clipping, and look for samples with extreme rewards or lengths"), step)]

    def _reward_plateau(self, step, metrics, groups) -> list[Fired | None]:
        cfg = self.cfg.reward_plateau
        value = _num(metrics.get("reward/mean"))
        if value is None or not math.isfinite(value):
            return []
        self._reward.append(value)
        if len(self._reward) < 2 * cfg.window:
            return []
        history = list(self._reward)
        before, last = statistics.fmean(history[: cfg.window]), statistics.fmean(history[cfg.window:])
        if last - before > cfg.threshold:
            return []
        self._reward.clear()  # the next warning needs two fresh windows
        return [self._fired("reward_plateau", "reward/mean", last, cfg.threshold, (
            f"no reward improvement: reward/mean averaged {last:.3g} over the last {cfg.window} steps and "
            f"{before:.3g} over the {cfg.window} before (a rise above {cfg.threshold:g} expected); the run may "
            "have converged; otherwise try another training.learning_rate or check that the reward can rise"),
            step)]


def announce(fired: Fired, say: Callable[[str], None]) -> None:
    """An alarm's `alarm` row in events.jsonl and, for a warning, its console line: a stop is raised with this
    message (`AlarmStop`), and saying it too would print it twice."""
    events.emit("alarm", **asdict(fired))
    if fired.policy != "stop":
        say(f"alarm ({fired.policy}) {fired.name}: {fired.message}")


class SkippedUpdates:
    """Counts the steps in a row whose update the trainer skipped (`skipped_nonfinite` > the alarm's threshold:
    a NaN or inf gradient, never applied). `check` gives each such step's alarm: a warning until `window` in a
    row, then a stop (policy `stop`); None on a step that applied its update, or with policy `off`. Used by the
    RL loop's `Alarms` and by the offline trainers (SFT, preference)."""

    def __init__(self, cfg: SkippedUpdateAlarm | None = None) -> None:
        self.cfg, self.count = cfg or SkippedUpdateAlarm(), 0

    def check(self, step: int, metrics: dict[str, Any]) -> Fired | None:
        shares = [v for k in ("skipped_nonfinite", "critic/skipped_nonfinite") if (v := _num(metrics.get(k))) is not None]
        share = max(shares, default=None)  # the policy's optimiser steps, or the critic's
        if share is None or share <= self.cfg.threshold or self.cfg.policy == "off":
            self.count = 0
            return None
        self.count += 1
        cause = next((k for k in NON_FINITE_KEYS if _num(metrics.get(k)) is not None
                      and not math.isfinite(metrics[k])), "grad_norm")
        stop = self.cfg.policy == "stop" and self.count >= self.cfg.window
        share_text = "its update" if share >= 1 else f"{share:.0%} of its optimiser steps"
        then = (f"{self.count} in a row: the run stops (the weights are the last good ones)" if stop else
                f"{self.count} in a row" + (f"; the run stops at {self.cfg.window}" if self.cfg.policy == "stop" else ""))
        message = (f"step {step} skipped {share_text}: {cause} was {_non_finite(float(metrics.get(cause, math.nan)))}"
                   f", so the gradient was not applied ({then}); lower training.learning_rate, look for NaN or "
                   "extreme rewards or inputs, and train in float32 if the model is in half precision")
        return Fired("skipped_update", "skipped_nonfinite", float(self.count), float(self.cfg.window),
                     "stop" if stop else "warn", message, step)


ENTROPY_FIX = ("lower training.learning_rate, add an entropy bonus (algorithm.entropy_coef), raise "
               "generation.temperature, or raise algorithm.clip_high")


def _non_finite(value: float) -> str:
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _non_finite_message(key: str, value: float, step: int) -> str:
    return (f"{key} is {_non_finite(value)} at step {step}: the update is broken; the run stops and no checkpoint "
            "of these weights is written (the last checkpoint is kept: resume from it); lower "
            "training.learning_rate, look for rewards of extreme size, and train in float32 if the model is in "
            "half precision")

