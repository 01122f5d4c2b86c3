"""What an episode's `StepResult.info` tells the run: whether it succeeded, and numbers worth a metric.

An environment defines success by reporting `info["solved"]` (a bool; the last turn's value counts). Where it
does, accuracy is the share of solved episodes; where it does not, an episode succeeds when its return reaches
1.0. A return alone is a poor measure once rewards are shaped: with a cost per turn a solved episode returns
less than 1.0, and accuracy computed from returns falls while more episodes are solved.

Every other number or bool an environment reports in `info` (the last value per episode) is averaged over the
episodes that reported it and logged as `env/<key>`, next to `env/turns` and `env/solved`. `env/turns` is the
loop's own count, one meaning everywhere: policy (assistant) turns per episode, each answered by one `step`. An
info key named like a metric of the loop (`turns`: an environment counting its own steps) is logged as
`env/info/<key>` so that it never overwrites the loop's number.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from tokenmill.types import Sample

SOLVED_THRESHOLD = 1.0 - 1e-6  # without info["solved"]: a return of 1.0 means solved
LOOP_FLAGS = ("turn_limit", "token_limit")  # set by the agent loop only when hit: shares of all episodes
LOOP_METRICS = ("turns",)  # the loop's own per-episode numbers: an info key of that name goes to env/info/<key>
MAX_INFO_KEYS = 20  # an environment reporting many keys logs the first ones, not hundreds of metrics


def episode_info(sample: Sample) -> dict[str, Any] | None:
    """The episode's info when the sample is an agent-loop episode (its row carries turns and info)."""
    row = sample.row
    if isinstance(row, dict) and isinstance(row.get("turns"), int) and isinstance(row.get("info"), dict):
        return row["info"]
    return None


def succeeded(sample: Sample, threshold: float = SOLVED_THRESHOLD) -> bool:
    """The environment's `info["solved"]` where it reports one; else whether the reward reaches `threshold`."""
    info = episode_info(sample)
    if info is not None and isinstance(info.get("solved"), bool):
        return info["solved"] and not math.isnan(sample.reward)
    return not math.isnan(sample.reward) and sample.reward >= threshold


def episode_metrics(samples: list[Sample], prefix: str = "env/") -> dict[str, float]:
    """Mean policy turns, the solved share and each numeric info key's mean over the episodes among `samples`
    (empty when none is an episode); an info key named like one of the loop's metrics goes under `info/`."""
    infos = [(s, info) for s in samples if (info := episode_info(s)) is not None]
    if not infos:
        return {}
    out = {f"{prefix}turns": statistics.fmean(s.row["turns"] for s, _ in infos),
           f"{prefix}solved": sum(succeeded(s) for s, _ in infos) / len(infos)}
    for flag in LOOP_FLAGS:
        out[f"{prefix}{flag}"] = sum(bool(info.get(flag)) for _, info in infos) / len(infos)
    keys = [k for k in dict.fromkeys(k for _, info in infos for k in info) if k not in (*LOOP_FLAGS, "solved")]
    for key in keys[:MAX_INFO_KEYS]:
        values = [float(v) for _, info in infos if isinstance(v := info.get(key), int | float)]
        if values and all(math.isfinite(v) for v in values):
            name = f"info/{key}" if key in LOOP_METRICS else key
            out[f"{prefix}{name}"] = statistics.fmean(values)
    return out
