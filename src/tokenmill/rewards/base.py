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
a string, a numeric string) becomes a failed score (`RewardResult(None, error=...)`) that is counted and
logged. A batch that fails as a whole is narrowed down so that only the samples that cause it fail: after a
raise the batch is split in halves, recursively; after a wrong-length answer or a timeout the samples are
scored one at a time, and a batch spends at most `MAX_TIMEOUTS` timeouts (a sample that hangs costs the
timeout once more, not a failed batch); once a batch has timed out, the function is called one sample at a
time from then on, so a later hang costs one timeout. Error texts name the line of the user's code that raised, or the
function's own definition (a wrong length, NaN, a string).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tokenmill.rewards.isolation import CallFailed, CallTimeout, make_caller
from tokenmill.types import RewardResult

# arguments that are not one value per sample (per-sample calls pass them as they are)
_SHARED = ("trainer_state", "log_extra", "log_metric")
# timeouts one batch may spend (the batched call's, then the samples' while retrying one at a time): one
# sample that hangs costs two, and a function that hangs on everything costs three, not one per sample
MAX_TIMEOUTS = 3


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


def _unwrap_partial(fn: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def callable_name(fn: Callable[..., Any]) -> str:
    """The name a reward is logged under: a function's name (through functools.partial), else its class's."""
    fn = _unwrap_partial(fn)
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
    if isinstance(v, (str, bytes)):  # "1" is refused, not read as 1.0: a string is most often a bug upstream
        return RewardResult(None, f"returned the string {v!r:.60}, not a number (return float(...) if meant)")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)  # numpy / torch scalars
        except (TypeError, ValueError):
            return RewardResult(None, f"not a number: {v!r:.60}")
    if math.isnan(v) or math.isinf(v):
        return RewardResult(None, f"non-finite value {v}")
    return RewardResult(float(v))


def defined_at(fn: Callable[..., Any]) -> str:
    """'name (file:line)' of a function's definition (through functools.partial; a callable instance's
    `__call__`), for error texts; just the name when Python cannot tell."""
    target = _unwrap_partial(fn)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__  # a callable instance: its class's method
    code = getattr(inspect.unwrap(target), "__code__", None)
    name = callable_name(fn)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


@dataclass
class _Failed:
    """A call that produced no usable list: why, and whether it ran out of time."""

    reason: str
    timed_out: bool = False
    wrong_length: bool = False


def _subset(kwargs: dict[str, Any], idx: list[int], n: int) -> dict[str, Any]:
    """The arguments of the samples `idx`: every per-sample list indexed, shared arguments as they are."""
    return {k: v if k in _SHARED or not isinstance(v, (list, tuple)) or len(v) != n else [v[i] for i in idx]
            for k, v in kwargs.items()}


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
        self.one_at_a_time = False  # set once a batched call times out
        self._timeouts = 0
        self._where: str | None = None  # defined_at(fn), once a failure needs it
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
        self._timeouts = 0
        results: list[RewardResult | None] = [None] * n
        if self.one_at_a_time and n > 1:
            self._singly(kwargs, list(range(n)), n, results)
        else:
            self._narrow(kwargs, list(range(n)), n, results)
        done = [r if r is not None else RewardResult(None, "not scored") for r in results]
        return self._with_extras(done)

    def _with_extras(self, results: list[RewardResult]) -> list[RewardResult]:
        """Each result with what the function logged for its sample (`log_extra` columns of one value per
        sample; a column whose length does not match the batch, after a narrowed-down failure, is left out)."""
        columns = {k: v for k, v in self.last_log.extra.items() if len(v) == len(results)}
        if not columns:
            return results
        return [replace(r, extra={k: v[i] for k, v in columns.items()}) for i, r in enumerate(results)]

    def _attempt(self, kwargs: dict[str, Any], size: int) -> list[RewardResult] | _Failed:
        """One call on `size` samples: their results, or why the call as a whole failed."""
        try:
            out, log = self._call(kwargs, timeout=self.timeout_s)  # one dict: any column name is safe
        except CallTimeout as exc:
            self._timeouts += 1
            return _Failed(str(exc), timed_out=True)
        except CallFailed as exc:
            return _Failed(str(exc))
        if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
            return _Failed(f"returned {type(out).__name__}, expected a list")
        if len(out) != size:
            return _Failed(f"returned {len(out)} values for {size} completions", wrong_length=True)
        for name, values in log.extra.items():
            self.last_log.extra.setdefault(name, []).extend(values)
        for name, values in log.metrics.items():
            self.last_log.metrics.setdefault(name, []).extend(values)
        return [self._value(v) for v in out]

    def _value(self, v: Any) -> RewardResult:
        """One returned value as a result; a value that is no score (NaN, a string) names the function's file:line,
        as a raise and a wrong length do."""
        result = _check_value(v)
        return result if result.error is None else RewardResult(None, self._located(result.error))

    def _narrow(self, kwargs: dict[str, Any], idx: list[int], n: int, results: list[RewardResult | None]) -> None:
        """Score the samples `idx`; when the call fails as a whole, find the samples that make it fail: halves
        after a raise, one sample at a time after a wrong length or a timeout (within MAX_TIMEOUTS). A function
        that is right alone but wrong in every batch fails all of them (it does not score each completion)."""
        got = self._attempt(kwargs if len(idx) == n else _subset(kwargs, idx, n), len(idx))
        if isinstance(got, list):
            for i, result in zip(idx, got, strict=True):
                results[i] = result
            return
        if len(idx) == 1:
            results[idx[0]] = RewardResult(None, self._located(got.reason))
            return
        if got.timed_out:
            self.one_at_a_time = True  # from now on: a sample that hangs costs its own timeout, not the batch's
        if not got.timed_out and not got.wrong_length:
            half = len(idx) // 2
            self._narrow(kwargs, idx[:half], n, results)
            self._narrow(kwargs, idx[half:], n, results)
            return
        self._singly(kwargs, idx, n, results)
        if got.wrong_length and all(results[i].error is None for i in idx):  # type: ignore[union-attr]
            # right alone, wrong in a batch: the function does not return one value per completion
            for i in idx:
                results[i] = RewardResult(None, self._located(got.reason))

    def _singly(self, kwargs: dict[str, Any], idx: list[int], n: int, results: list[RewardResult | None]) -> None:
        """Score the samples `idx` one call each, while the batch has timeouts left to spend."""
        for i in idx:
            if self._timeouts >= MAX_TIMEOUTS:
                results[i] = RewardResult(None, self._located(
                    f"not scored: {MAX_TIMEOUTS} calls of this batch got no result within {self.timeout_s:g}s"))
            else:
                self._narrow(kwargs, [i], n, results)

    def _located(self, reason: str) -> str:
        """The reason, naming the function's definition unless it already points into the function's file."""
        if self._where is None:
            self._where = defined_at(self.fn)
        where = self._where
        file = where.rpartition("(")[2].rpartition(":")[0]
        return reason if file and f"{file}:" in reason else f"{reason}; {where}"

    def close(self) -> None:
        self._call.close()
