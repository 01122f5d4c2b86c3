"""Reward preview: sample K completions for N prompts of the configured data with tokenmill's engine, and
score them with every reward the run would use, showing each reward's score (or error) per sample.

User code never runs in the Composer's own process: each code reward is compiled here (a syntax error is
reported without running anything), then executed and called inside a forked worker of tokenmill's reward
isolation (`rewards/isolation.py`), which is killed when it runs past the reward's `timeout_s`. An infinite
loop, at module level or in the function, therefore comes back as an inline error after `timeout_s`. Import
strings from the config are resolved inside the worker too. The same code, written to the run folder,
is what a launched run imports (`path/to/file.py:function`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from tokenmill.composer.configs import RewardCode
from tokenmill.config.rewards import RewardFunctionConfig, RewardModelConfig
from tokenmill.config.schema import RLConfig
from tokenmill.types import ConfigError, RewardResult, TokenmillError

MAX_PROMPTS = 16
MAX_SAMPLES = 16
REWARD_MODEL_TIMEOUT_S = 120.0  # loading one, then scoring with it, each (a 7B model loads in about a minute)


class PreviewError(TokenmillError):
    """The preview cannot run; `errors` are [{"path", "message"}] naming the field to fix."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{e['path']}: {e['message']}" for e in errors))
        self.errors = errors


def _filtered_call(fn: Callable[..., Any], per_sample: bool) -> Callable[..., Any]:
    """fn called as FunctionReward calls it: TRL's keyword arguments, the ones it accepts, awaited if async."""
    from tokenmill.rewards.base import invoke

    return lambda prompts, completions, **cols: invoke(
        fn, {"prompts": prompts, "completions": completions, **cols}, per_sample=per_sample)


def code_reward_worker(code: str, function: str, per_sample: bool, filename: str) -> Callable[..., Any]:
    """The batched function a forked worker runs: execute the user's source, then call `function`."""
    loaded: dict[str, Callable[..., Any]] = {}

    def call(prompts: list[Any], completions: list[str], **columns: list[Any]) -> Any:
        if "fn" not in loaded:  # the worker keeps its module between calls
            namespace: dict[str, Any] = {"__name__": "tokenmill_composer_reward", "__file__": filename}
            exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - user code, in the worker only
            fn = namespace.get(function)
            if not callable(fn):
                raise NameError(f"the code defines no function {function!r}")
            loaded["fn"] = _filtered_call(fn, per_sample)
        return loaded["fn"](prompts, completions, **columns)

    return _as_defined(call, code, function, filename)


def _as_defined(call: Callable[..., Any], code: str, function: str, filename: str) -> Callable[..., Any]:
    """`call` named after the user's function, and `__wrapped__` by a stand-in defined at that function's
    line of the page's code: error texts (`rewards.base.defined_at`) then point at `<reward x>:line`, not at
    this wrapper. The stand-in takes every keyword, as `call` does (`inspect.signature` follows
    `__wrapped__`). The line is read from the syntax tree; nothing of the user's code runs here."""
    import ast

    tree = ast.parse(code, filename)
    line = next((n.lineno for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == function), 1)
    stand_in: dict[str, Any] = {}
    exec(compile("\n" * (line - 1) + f"def {function}(**columns): pass", filename, "exec"), stand_in)  # noqa: S102
    call.__name__ = call.__qualname__ = function
    call.__wrapped__ = stand_in[function]  # type: ignore[attr-defined]
    return call


def import_reward_worker(spec: str, per_sample: bool, field: str) -> Callable[..., Any]:
    """Like `code_reward_worker` for a config's import string, resolved inside the worker."""
    loaded: dict[str, Callable[..., Any]] = {}

    def call(prompts: list[Any], completions: list[str], **columns: list[Any]) -> Any:
        if "fn" not in loaded:
            from tokenmill.config.imports import resolve

            loaded["fn"] = _filtered_call(resolve(spec, field), per_sample)
        return loaded["fn"](prompts, completions, **columns)

    return call


class Previewer:
    """Holds one loaded policy between previews (loading is the slow part) and runs one preview at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[str, ...] | None = None
        self._model: Any = None
        self._tokenizer: Any = None

    def _policy(self, cfg: RLConfig) -> tuple[Any, Any, float]:
        from tokenmill.training.model import load_policy, resolve_device

        key = (cfg.model.path, cfg.model.tokenizer_path or "", cfg.model.device, cfg.model.attn_implementation or "")
        if key == self._key:
            return self._model, self._tokenizer, 0.0
        start = time.perf_counter()
        self._key = self._model = self._tokenizer = None
        plain = cfg.model.model_copy(update={"lora": cfg.model.lora.model_copy(update={"rank": 0})})
        try:
            model, tok = load_policy(plain, resolve_device(cfg.model.device))  # fresh LoRA adapters are a no-op
        except ConfigError as exc:
            raise PreviewError([{"path": "model.path", "message": str(exc).removeprefix("model.path: ")}]) from None
        self._model, self._tokenizer, self._key = model.eval(), tok, key
        return model, tok, time.perf_counter() - start

    def preview(self, cfg: RLConfig, codes: list[RewardCode], prompts: int = 4, samples: int = 4,
                seed: int = 0, reward_model_timeout_s: float = REWARD_MODEL_TIMEOUT_S) -> dict[str, Any]:
        if cfg.env is not None:
            raise PreviewError([{"path": "env", "message": "the preview scores single completions; an "
                                 "environment's episodes are not previewed"}])
        with self._lock:
            return self._preview(cfg, codes, max(1, min(prompts, MAX_PROMPTS)), max(1, min(samples, MAX_SAMPLES)),
                                 seed, reward_model_timeout_s)

    def _preview(self, cfg: RLConfig, codes: list[RewardCode], n: int, k: int, seed: int,
                 reward_model_timeout_s: float) -> dict[str, Any]:
        from tokenmill.engines.local.hf import HFEngine
        from tokenmill.rollout.generator import build_generator

        rows, task_reward = _rows(cfg, n)
        reward_set, infos = _rewards(cfg, codes, task_reward, reward_model_timeout_s)
        try:
            model, tok, load_s = self._policy(cfg)
        except PreviewError:
            reward_set.close()
            raise
        generator = build_generator(cfg, HFEngine(model, tok, seed=seed), tok, reward_set)
        generator.params = dataclasses.replace(generator.params, n=k)  # k samples of each previewed row
        try:
            t0 = time.perf_counter()
            prompt_ids, completions = generator.sample(rows)
            t1 = time.perf_counter()
            groups = generator.score(rows, prompt_ids, completions, version=0)
            t2 = time.perf_counter()
        finally:
            reward_set.close()  # kills the forked workers
        for info in infos:
            info["seconds"] = reward_set.last_seconds.get(info["name"])
        return _report(groups, infos, [], {"load": load_s, "generate": t1 - t0, "score": t2 - t1})


def _rows(cfg: RLConfig, n: int) -> tuple[list[dict[str, Any]], Any]:
    from tokenmill.data.build import build_datasets

    small = cfg.model_copy(update={"data": cfg.data.model_copy(update={"num_train": n, "num_eval": 0})})
    try:
        train, _, task_reward = build_datasets(small)
    except ConfigError as exc:
        path, _, message = str(exc).partition(": ")
        raise PreviewError([{"path": path if message else "data", "message": message or str(exc)}]) from None
    rows = [train[i] for i in range(min(n, len(train)))]
    if not rows:
        raise PreviewError([{"path": "data", "message": "the dataset has no rows"}])
    return rows, task_reward


class TimedModelReward:
    """A reward model for the preview whose loading and scoring each get `timeout_s`, in daemon threads: a model
    that hangs (a stalled file system, a checkpoint far too large for the machine) costs the preview
    `timeout_s` and an inline error, never the Composer's request thread. Loading starts at the first call,
    after the policy is loaded: transformers' loading is not safe in two threads at once. A thread past its
    time cannot be killed: it is abandoned (and may still be loading when the next preview loads a model)."""

    def __init__(self, rc: RewardModelConfig, index: int, timeout_s: float) -> None:
        self.name = rc.name or rc.path.rstrip("/").split("/")[-1]  # ModelReward's default name
        self.weight = rc.weight
        self.timeout_s = timeout_s
        self._field = f"rewards.{index}.path"
        self._config = rc
        self._load: _Background | None = None

    def __call__(self, prompts: list[Any], completions: list[str], columns: dict[str, list[Any]],
                 **context: Any) -> list[RewardResult]:
        if self._load is None:
            self._load = _Background(lambda: _model_reward(self._config))
        try:
            reward = self._load.result(self.timeout_s, "the reward model did not load")
            return _Background(lambda: reward(prompts, completions, columns, **context)).result(
                self.timeout_s, "the reward model did not score")
        except (TimeoutError, _Failed) as exc:
            return [RewardResult(None, f"{self._field}: {exc}")] * len(completions)

    def close(self) -> None:
        pass  # a reward model holds no process; an abandoned thread ends with its call


class _Failed(Exception):
    pass


class _Background:
    """`fn()` started in a daemon thread; `result` waits for it until `timeout_s` after the start."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: str | None = None
        self._start = time.monotonic()

        def run() -> None:
            try:
                self._value = fn()
            except Exception as exc:  # noqa: BLE001 - reported inline, like a reward function's error
                self._error = f"{type(exc).__name__}: {exc}"
            self._done.set()

        threading.Thread(target=run, name="composer-reward-model", daemon=True).start()

    def result(self, timeout_s: float, what: str) -> Any:
        if not self._done.wait(max(0.0, self._start + timeout_s - time.monotonic())):
            raise TimeoutError(f"{what} within {timeout_s:g}s (abandoned)")
        if self._error is not None:
            raise _Failed(self._error)
        return self._value


def _model_reward(rc: RewardModelConfig) -> Any:
    from tokenmill.rewards.model import ModelReward

    return ModelReward(rc.path, name=rc.name, weight=rc.weight, batch_size=rc.batch_size)


def _rewards(cfg: RLConfig, codes: list[RewardCode], task_reward: Any,
             model_timeout_s: float) -> tuple[Any, list[dict[str, Any]]]:
    """The reward set to score with (task, config, code: built as a run builds its own, except that the
    config's functions are resolved in their workers and reward models are timed) and a description of each.
    A code reward with a syntax error is described, with its error, but not run."""
    from tokenmill.rewards.base import FunctionReward
    from tokenmill.rewards.build import build_rewards, builtin_function_reward, judge_reward

    infos: list[dict[str, Any]] = []
    if task_reward is not None:
        infos.append(_info(cfg.data.task, cfg.data.task_reward_weight, "task"))
    built: list[Any] = []
    for i, rc in enumerate(cfg.rewards):
        if isinstance(rc, RewardFunctionConfig):
            fn = import_reward_worker(rc.function, rc.per_sample, f"rewards.{i}.function")
            name = rc.name or rc.function.rpartition(":")[2]
            built.append(FunctionReward(fn, name=name, weight=rc.weight, timeout_s=rc.timeout_s,
                                        isolation=rc.isolation))
        elif rc.type == "judge":  # its requests are bounded by its own timeout and retries
            built.append(judge_reward(rc, i, cfg.tracking.output_dir))
        elif rc.type == "builtin":
            built.append(builtin_function_reward(rc))
        else:
            built.append(TimedModelReward(rc, i, model_timeout_s))
        infos.append(_info(built[-1].name, rc.weight, "config"))
    for code in codes:
        filename = f"<reward {code.name}>"
        try:
            compile(code.code, filename, "exec")  # syntax errors without running anything
        except SyntaxError as exc:
            infos.append(_info(code.name, code.weight, "code", f"SyntaxError: {exc.msg} (line {exc.lineno})", 0.0))
            continue
        fn = code_reward_worker(code.code, code.function, code.per_sample, filename)
        built.append(FunctionReward(fn, name=code.name, weight=code.weight, timeout_s=code.timeout_s))
        infos.append(_info(code.name, code.weight, "code"))
    names = [i["name"] for i in infos]
    duplicated = sorted({x for x in names if names.count(x) > 1})
    broken = [{"path": f"rewards.{i['name']}", "message": i["error"]} for i in infos if i["error"]]
    if broken and not built and task_reward is None:  # nothing left to score with: say why
        raise PreviewError(broken)
    try:
        if duplicated:
            raise ConfigError(f"rewards: reward names must be unique: {duplicated} repeat")
        return build_rewards(cfg.model_copy(update={"rewards": []}), extra=built, task_reward=task_reward), infos
    except ConfigError as exc:
        for reward in built:
            reward.close()
        path, _, message = str(exc).partition(": ")
        raise PreviewError([{"path": path, "message": message}]) from None


def _info(name: str, weight: float, source: str, error: str | None = None,
          seconds: float | None = None) -> dict[str, Any]:
    return {"name": name, "weight": weight, "source": source, "seconds": seconds, "error": error}


def _report(groups: list[Any], infos: list[dict[str, Any]], errors: list[str],
            seconds: dict[str, float]) -> dict[str, Any]:
    """The preview's response body (see API.md)."""
    upfront = {i["name"]: i["error"] for i in infos if i["error"]}  # e.g. syntax errors: never called
    out_samples, out_groups = [], []
    for g in groups:
        totals = []
        for j, s in enumerate(g.samples):
            errs = {**{k: v for k, v in s.reward_errors.items() if v}, **upfront}
            scores = {**{k: v for k, v in s.rewards.items()}, **dict.fromkeys(upfront)}
            total = None if math.isnan(s.reward) else s.reward
            totals.append(total)
            out_samples.append({"group": g.group_id, "index": j, "prompt": s.prompt, "completion": s.completion,
                                "stop": s.stop_reason.value, "scores": scores, "errors": errs, "total": total})
        valid = [t for t in totals if t is not None]
        std = statistics.pstdev(valid) if len(valid) > 1 else 0.0
        out_groups.append({"group": g.group_id, "prompt": g.samples[0].prompt,
                           "mean": statistics.fmean(valid) if valid else None, "std": std,
                           "zero_variance": len(set(valid)) <= 1})
    for info in infos:  # one error per reward when every sample of it failed: the first sample's
        if info["error"] is None:
            failed = [smp["errors"].get(info["name"]) for smp in out_samples]
            if failed and None not in failed:
                info["error"] = failed[0]
    zero = sum(g["zero_variance"] for g in out_groups) / max(1, len(out_groups))
    return {"samples": out_samples, "rewards": infos, "groups": out_groups, "zero_variance_fraction": zero,
            "errors": errors, "seconds": seconds}
