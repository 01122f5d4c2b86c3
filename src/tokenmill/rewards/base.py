"""Rewards: functions written for TRL's GRPOTrainer, used unchanged; reward models; a weighted set of both.

A reward function is called the way TRL's GRPOTrainer calls it, everything by keyword:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], <each dataset column>=[...],
       trainer_state=RewardState(...), log_extra=..., log_metric=...)

so `def reward_len(completions, **kwargs)` works as it does in TRL. A function without `**kwargs` is
given only the arguments it names. When a prompt is a list of chat messages, its completion is given as
`[{"role": "assistant", "content": text}]` (TRL's conversational format). An `async def` function is
awaited. Returning None for a sample means "does not apply": it is left out of that sample's total.

With `per_sample=True` (chosen explicitly, never guessed) the function scores one sample at a time:
`fn(prompt, completion, **that row's values)`, the same arguments with one row's values.

Every call is timed out, and whatever a function does wrong (raise, hang, return the wrong length, NaN,
a string) becomes a failed score (`RewardResult(None, error=...)`) that is counted and logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.rewards.isolation import CallFailed, CallTimeout, make_caller
from tokenmill.types import RewardResult

# arguments that are not one value per sample (per-sample calls pass them as they are)
_SHARED = ("trainer_state", "log_extra", "log_metric")


@dataclass
class RewardState:
    """Given as `trainer_state`: the fields of transformers' TrainerState that reward shaping reads.

    global_step is the number of policy updates behind the weights that generated the completions (the
    policy version), as TRL's `trainer_state.global_step` is at generation time; max_steps is
    `controller.steps`."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float | None = None
    num_train_epochs: int = 0
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


class Reward(Protocol):
    """Scores a batch of completions. `columns` holds the dataset columns of each row, batched;
    `completion_ids` the sampled token ids of each completion; `state` the training progress."""

    name: str
    weight: float

    def __call__(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        state: RewardState | None = None,
    ) -> list[RewardResult]: ...

    def close(self) -> None:
        """Stop worker processes and release models; idempotent (`RewardSet.close` calls it on each)."""
        ...


def is_conversational(prompt: Any) -> bool:
    """A prompt that is a list of chat messages (TRL's test: a list whose first item has a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def trl_completion(prompt: Any, text: str) -> Any:
    """The completion as TRL hands it to reward functions: the text, or one assistant message in a list."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def callable_name(fn: Callable[..., Any]) -> str:
    """The name a reward is logged under: a function's name (through functools.partial), else its class's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword arguments fn can take: all of them with **kwargs, else those it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: give everything, as TRL does
        return {k: v for k, v in kwargs.items() if k not in skip}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {k: v for k, v in kwargs.items() if k not in skip}
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {k: v for k, v in kwargs.items() if k in names and k not in skip}


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """fn(*args, **kwargs); arguments that do not fit its signature fail naming what it was given."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except ValueError:  # no signature to check against
        pass
    except TypeError as exc:
        given = ", ".join(["<prompt>", "<completion>"][: len(args)] + sorted(kwargs))
        raise TypeError(f"{exc}; reward functions are called by keyword as TRL calls them, given: {given}") from None
    return fn(*args, **kwargs)


async def _gather(awaitables: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*awaitables))


def _resolve(values: list[Any]) -> list[Any]:
    """Await what an async function returned (all of a batch's awaitables concurrently)."""
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:
        gathered = _gather([values[i] for i in pending])
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            done = asyncio.run(gathered)
        else:  # called from inside a running loop (a notebook, or a worker forked from one): a thread of its own
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                done = pool.submit(asyncio.run, gathered).result()
        values = list(values)
        for i, v in zip(pending, done, strict=True):
            values[i] = v
    return values


def invoke(fn: Callable[..., Any], kwargs: dict[str, Any], *, per_sample: bool = False) -> Any:
    """Call fn with TRL's keyword arguments (`prompts`, `completions`, ... as `FunctionReward` builds them)
    and return what it returns, awaited if it is async. per_sample: one call per sample, as
    fn(prompt, completion, **that sample's values), the rest (trainer_state, log_*) as they are."""
    if not per_sample:
        [out] = _resolve([_call(fn, (), _accepted(fn, kwargs))])
        return out
    prompts, completions = kwargs["prompts"], kwargs["completions"]
    rows = {k: v for k, v in kwargs.items() if k not in ("prompts", "completions", *_SHARED)}
    shared = {k: kwargs[k] for k in _SHARED if k in kwargs}
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row = {k: v[i] for k, v in rows.items()} | shared
        out.append(_call(fn, (prompt, completion), _accepted(fn, row, skip=("prompt", "completion"))))
    return _resolve(out)


@dataclass
class CallLog:
    """What a function reported through TRL's `log_extra(column, values)` and `log_metric(name, value)`."""

    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list[Any]) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))


class _WorkerCall:
    """What the worker runs: `invoke` with TRL's logging callbacks, returning (values, CallLog). The
    callbacks live in the worker, so only plain data crosses back."""

    def __init__(self, fn: Callable[..., Any], per_sample: bool) -> None:
        self.fn, self.per_sample = fn, per_sample

    def __call__(self, kwargs: dict[str, Any]) -> tuple[Any, CallLog]:
        log = CallLog()
        kwargs = kwargs | {"log_extra": log.log_extra, "log_metric": log.log_metric}
        out = invoke(self.fn, kwargs, per_sample=self.per_sample)
        if not isinstance(out, (list, tuple, str, bytes, dict)):  # the last three are reported as wrong
            try:
                out = list(out)  # numpy arrays, tensors, generators: plain values cross the pipe
            except TypeError:
                pass
        return out, log


def _check_value(v: Any) -> RewardResult:
    if v is None:
        return RewardResult(None)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)  # numpy / torch scalars
        except (TypeError, ValueError):
            return RewardResult(None, f"not a number: {v!r:.60}")
    if math.isnan(v) or math.isinf(v):
        return RewardResult(None, f"non-finite value {v}")
    return RewardResult(float(v))


class FunctionReward:
    """A Python reward function run under a timeout (in a forked worker by default)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        weight: float = 1.0,
        timeout_s: float = 10.0,
        per_sample: bool = False,
        isolation: str = "process",
    ) -> None:
        self.fn = fn
        self.name = name or callable_name(fn)
        self.weight = weight
        self.timeout_s = timeout_s
        self.per_sample = per_sample
        self.last_log = CallLog()
        self._call = make_caller(_WorkerCall(fn, per_sample), isolation)

    def __call__(
        self,
        prompts: list[Any],
        completions: list[str],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        state: RewardState | None = None,
    ) -> list[RewardResult]:
        n = len(completions)
        kwargs: dict[str, Any] = dict(columns)  # TRL's own arguments win over a column of the same name
        kwargs["prompts"] = prompts
        kwargs["completions"] = [trl_completion(p, c) for p, c in zip(prompts, completions, strict=True)]
        if completion_ids is not None:
            kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
        kwargs["trainer_state"] = state if state is not None else RewardState()
        self.last_log = CallLog()
        try:
            out, self.last_log = self._call(kwargs, timeout=self.timeout_s)  # one dict: any column name is safe
        except (CallTimeout, CallFailed) as exc:
            return [RewardResult(None, str(exc))] * n
        if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
            return [RewardResult(None, f"returned {type(out).__name__}, expected a list")] * n
        if len(out) != n:
            return [RewardResult(None, f"returned {len(out)} values for {n} completions")] * n
        return [_check_value(v) for v in out]

    def close(self) -> None:
        self._call.close()
