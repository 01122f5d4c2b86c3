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

import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from tokenmill.composer.configs import RewardCode
from tokenmill.config.schema import RewardFunctionConfig, RLConfig
from tokenmill.types import ConfigError, TokenmillError

MAX_PROMPTS = 16
MAX_SAMPLES = 16


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
        from tokenmill.controller.build import load_policy, resolve_device

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
                seed: int = 0) -> dict[str, Any]:
        if cfg.env is not None:
            raise PreviewError([{"path": "env", "message": "the preview scores single completions; an "
                                 "environment's episodes are not previewed"}])
        with self._lock:
            return self._preview(cfg, codes, max(1, min(prompts, MAX_PROMPTS)), max(1, min(samples, MAX_SAMPLES)),
                                 seed)

    def _preview(self, cfg: RLConfig, codes: list[RewardCode], n: int, k: int, seed: int) -> dict[str, Any]:
        from tokenmill.engines.hf import HFEngine
        from tokenmill.rollout.generator import Generator
        from tokenmill.types import SamplingParams

        rows, task_reward = _rows(cfg, n)
        rewards, infos, errors = _rewards(cfg, codes, task_reward)
        model, tok, load_s = self._policy(cfg)
        if not rewards:
            errors.append("no reward to score with: add a reward, or choose a data.task")
        from tokenmill.rewards.set import RewardSet

        reward_set = RewardSet(rewards)
        gen = cfg.generation
        params = SamplingParams(max_tokens=gen.max_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                top_k=gen.top_k, n=k, stop=tuple(gen.stop))
        generator = Generator(HFEngine(model, tok, seed=seed), tok, reward_set, params, cfg.data.prompt_column)
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
        return _report(groups, infos, errors, {"load": load_s, "generate": t1 - t0, "score": t2 - t1})


def _rows(cfg: RLConfig, n: int) -> tuple[list[dict[str, Any]], Any]:
    from tokenmill.controller.build import build_datasets

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


def _rewards(cfg: RLConfig, codes: list[RewardCode], task_reward: Any) -> tuple[list[Any], list[dict], list[str]]:
    """The rewards to score with (task, config, code), their descriptions, and problems found up front."""
    from tokenmill.rewards.base import FunctionReward
    from tokenmill.rewards.model import ModelReward

    rewards: list[Any] = []
    infos: list[dict[str, Any]] = []
    errors: list[str] = []

    def add(reward: Any, source: str, error: str | None = None) -> None:
        rewards.append(reward)
        infos.append({"name": reward.name, "weight": reward.weight, "source": source, "seconds": None,
                      "error": error})

    if task_reward is not None:
        add(FunctionReward(task_reward, name=cfg.data.task, weight=cfg.data.task_reward_weight), "task")
    for i, rc in enumerate(cfg.rewards):
        if isinstance(rc, RewardFunctionConfig):
            fn = import_reward_worker(rc.function, rc.per_sample, f"rewards.{i}.function")
            name = rc.name or rc.function.rpartition(":")[2]
            add(FunctionReward(fn, name=name, weight=rc.weight, timeout_s=rc.timeout_s, isolation=rc.isolation),
                "config")
        else:
            try:
                add(ModelReward(rc.path, name=rc.name, weight=rc.weight, batch_size=rc.batch_size), "config")
            except (OSError, ValueError) as exc:
                errors.append(f"rewards.{i}.path: cannot load the reward model: {exc}")
    for code in codes:
        filename = f"<reward {code.name}>"
        try:
            compile(code.code, filename, "exec")  # syntax errors without running anything
        except SyntaxError as exc:
            infos.append({"name": code.name, "weight": code.weight, "source": "code", "seconds": 0.0,
                          "error": f"SyntaxError: {exc.msg} (line {exc.lineno})"})
            continue
        fn = code_reward_worker(code.code, code.function, code.per_sample, filename)
        add(FunctionReward(fn, name=code.name, weight=code.weight, timeout_s=code.timeout_s), "code")
    names = [i["name"] for i in infos]
    duplicated = sorted({x for x in names if names.count(x) > 1})
    if duplicated:
        for r in rewards:
            r.close()
        raise PreviewError([{"path": "rewards", "message": f"reward names must be unique: {duplicated} repeat"}])
    return rewards, infos, errors


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
    for info in infos:  # one error per reward when every sample of it failed the same way
        if info["error"] is None:
            failed = {smp["errors"].get(info["name"]) for smp in out_samples}
            if len(failed) == 1 and None not in failed:
                info["error"] = failed.pop()
    zero = sum(g["zero_variance"] for g in out_groups) / max(1, len(out_groups))
    return {"samples": out_samples, "rewards": infos, "groups": out_groups, "zero_variance_fraction": zero,
            "errors": errors, "seconds": seconds}
