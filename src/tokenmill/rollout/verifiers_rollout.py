"""`VerifiersRollout`: the `Rollout` of a verifiers environment (`env: {verifiers: ...}`).

The environment runs its own episodes: `vf.Env.run_episode` plays each task with its agent (its harness, its
tool servers, its interception of every model call) and scores the trace with the task's rewards and judges.
Only the model is ours: the episodes' client points at tokenmill's proxy endpoint,
`http://127.0.0.1:PORT/verifiers/v1`, served by a continuous-batching engine over the policy's own module;
the server records every call's exact prompt ids, sampled ids, logprobs and policy version under the trace it
belongs to (verifiers' `X-Session-ID` header; `engines/server/recorder.py`), so the samples are the token ids
the engine produced, never a re-tokenisation of the conversation; a trace's reward is its rewards summed with
their weights (a multi-agent env's seats are traces of their own, each its own samples).

    >>> actor = VerifiersRollout(env, engine, tokenizer, params)     # doctest: +SKIP
    >>> groups, info = actor.rollout(rows, version=3)               # params.n episodes per row

A failed episode (the environment raised, a tool server died, scoring failed) is a sample with reward NaN and
the error in `reward_errors["env"]`, as in the agent loop; the loop drops it like an unscored sample.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.engines.server.openai_wire import ChatBody
from tokenmill.engines.server.recorder import EpisodeError, EpisodeRecorder, RecordedEpisode
from tokenmill.serving import ApiError
from tokenmill.tracking.stages import stage
from tokenmill.types import ConfigError, Group, Sample, SamplingParams, StopReason

log = logging.getLogger("tokenmill.verifiers")
MODEL_NAME = "policy"


@dataclass
class _Played:
    """One episode as played: the recorder's token truth, the verifiers episode, or the error that ended it."""

    group: int
    task: dict[str, Any]
    recorded: RecordedEpisode | None = None
    rewards: dict[str, float | None] | None = None
    metrics: dict[str, float] | None = None
    messages: list[dict[str, Any]] | None = None  # the conversation of the episode's last trace
    reward: float = math.nan
    error: str | None = None


class VerifiersRollout:
    """Episodes of a loaded verifiers environment (`envs.verifiers_env.LoadedEnv`) against `engine`'s model,
    `params.n` per row (the GRPO group); rows are `{"task": i, ...}` with `i` an index into its tasks.

    max_concurrent:  episodes in flight at once (the engine batches their calls)
    timeout_s:       a model call without an answer by then is cancelled (the episode fails)
    """

    plays_episodes = True  # the held-out evaluation runs episodes (controller.evaluate.evaluate_agent)

    def __init__(self, loaded: Any, engine: Any, tokenizer: Any, params: SamplingParams, *,
                 max_concurrent: int = 64, timeout_s: float = 600.0, seed: int = 0) -> None:
        from tokenmill.engines.local.continuous import ContinuousEngine
        from tokenmill.engines.server.app import create_app
        from tokenmill.serving import start_in_thread

        model = getattr(engine, "model", None)
        if model is None:
            raise ConfigError("engine.placement: env.verifiers serves the policy from this process "
                              "(engine.placement colocated or thread)")
        self.loaded, self.engine, self.tokenizer, self.params = loaded, engine, tokenizer, params
        self.max_concurrent = max_concurrent
        self.recorder = EpisodeRecorder(ttl_s=timeout_s)
        # the serving engine samples from the policy's own module: nothing to sync; it runs only in `rollout`
        self.serving = ContinuousEngine(model, tokenizer, seed=seed, autocast_dtype=getattr(engine, "autocast_dtype",
                                                                                             None))
        app = create_app(self.serving, model_name=MODEL_NAME, recorder=self.recorder, request_timeout_s=timeout_s,
                         default_max_tokens=params.max_tokens, max_tokens_cap=params.max_tokens,
                         extra_routers=[_trace_route()])
        try:
            self.server, _ = start_in_thread(app, "127.0.0.1", 0)
        except BaseException:
            self.serving.close()
            raise
        self.url = self.server.url

    # ------------------------------------------------------------------------------------------ the protocol
    def rollout(
        self, rows: Sequence[dict[str, Any]], version: int = 0, first_group: int = 0, *,
        group_size: int | None = None, params: SamplingParams | None = None,
    ) -> tuple[list[Group], dict[str, float]]:
        """`group_size` episodes per row (default `params.n`); each sample keeps the version the engine
        reported for its calls."""
        g = group_size or self.params.n
        params = params or self.params
        model, training = self.serving.model, self.serving.model.training
        self.serving.version = max(version, int(getattr(self.engine, "version", 0)))
        model.eval()
        try:
            with stage("generate") as t:
                played = asyncio.run(self._play([(row, i) for i, row in enumerate(rows) for _ in range(g)], params))
                if t is not None:
                    t.add_tokens("generate", sum(sum(s.loss_mask) for p in played if p.recorded
                                                 for s in p.recorded.segments))
        finally:
            model.train(training)
        groups: dict[int, list[Sample]] = {i: [] for i in range(len(rows))}
        for p in played:
            groups[p.group] += self._samples(p, first_group + p.group)
        failed = sum(p.error is not None for p in played)
        return [Group(first_group + i, tuple(groups[i])) for i in range(len(rows))], {
            "verifiers/episodes": float(len(played)), "verifiers/failed": float(failed)}

    def close(self) -> None:
        self.server.stop()
        self.serving.close()

    # ------------------------------------------------------------------------------------------ episodes
    async def _play(self, queue: list[tuple[dict[str, Any], int]], params: SamplingParams) -> list[_Played]:
        env = self.loaded.env
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(row: dict[str, Any], group: int) -> list[_Played]:
            async with gate:
                return await self._episode(row, group, params)

        async with env.serving():
            return [p for played in await asyncio.gather(*(one(row, grp) for row, grp in queue)) for p in played]

    async def _episode(self, row: dict[str, Any], group: int, params: SamplingParams) -> list[_Played]:
        """The episode of `row`'s task: one `_Played` per trace (one per seat of a multi-agent env)."""
        import verifiers.v1 as vf

        sampling = {"temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
                    "max_tokens": params.max_tokens}
        if params.top_k:
            sampling["top_k"] = params.top_k
        # one endpoint for every episode: each call is recorded under its trace (verifiers' X-Session-ID)
        ctx = vf.ModelContext(model=MODEL_NAME, sampling=vf.Sampling(**sampling), client=vf.EvalClientConfig(
            base_url=f"{self.url}/verifiers/v1", api_key_var="TOKENMILL_VERIFIERS_KEY"))
        try:
            episode = await self.loaded.env.run_episode(self.loaded.tasks[row["task"]], ctx)
        except Exception as exc:  # noqa: BLE001 - an episode that raises outside the env's own boundary
            return [self._failed(_Played(group, dict(row), error=f"{type(exc).__name__}: {_line(str(exc))}"))]
        failed = _error(episode.errors) or (None if episode.ok or episode.traces else "the episode ran no agent")
        if not episode.traces:
            return [self._failed(_Played(group, dict(row), error=failed))]
        return [self._played(trace, group, row, failed) for trace in episode.traces]

    def _played(self, trace: Any, group: int, row: dict[str, Any], failed: str | None) -> _Played:
        from verifiers.v1.dialects.chat import message_to_wire

        played = _Played(group, dict(row), error=failed or _error(trace.errors))
        played.rewards = {name: (r.value if r is not None else None) for name, r in trace.rewards.items()}
        played.metrics = {name: v for name, v in trace.metrics.items() if v is not None}
        played.messages = [message_to_wire(m) for m in trace.messages]  # OpenAI's shape
        if played.error is None:
            played.reward = trace.reward
        try:  # the rewards go on the samples; the recorder hands over the trace's token truth
            played.recorded = self.recorder.finish(trace.id, 0.0)
        except EpisodeError:  # no call was recorded under this trace
            played.error = played.error or "the episode made no model call"
        return self._failed(played) if played.error else played

    def _failed(self, played: _Played) -> _Played:
        log.warning("verifiers episode of task %s failed: %s", played.task.get("task"), played.error)
        return played

    def _samples(self, p: _Played, group_id: int) -> list[Sample]:
        row = {**p.task, "verifiers": self.loaded.spec}
        if p.recorded is None or not p.recorded.segments:
            eos = self.tokenizer.eos_token_id
            return [Sample(tokens=(eos,), loss_mask=(0,), logprobs=(0.0,), prompt_len=1, prompt=p.task.get("prompt"),
                           completion="", stop_reason=StopReason.STOP, version=0, group_id=group_id,
                           reward=math.nan, rewards={"env": None}, reward_errors={"env": p.error or "no calls"},
                           row=row)]
        errors = {"env": p.error} if p.error else {}
        rewards = {"env": None if p.error else p.reward, **(p.rewards or {})}
        # turns / info: what the agent loop's rows carry, so env/turns and env/<metric> are logged alike
        row |= {"turns": p.recorded.calls, "info": dict(p.metrics or {}), "messages": p.messages or []}
        return [replace(s, reward=p.reward, rewards=rewards, reward_errors=errors, row=row)
                for s in p.recorded.samples(group_id)]


def _error(errors: list[Any]) -> str | None:
    """The first of verifiers' recorded errors, in one line (None when there is none)."""
    return f"{errors[0].type}: {_line(str(errors[0].message))}" if errors else None


def _line(text: str) -> str:
    return " ".join(text.split())[:500]


def _trace_route() -> APIRouter:
    """`POST /verifiers/v1/chat/completions`: the proxy's recorded chat route, the episode being the verifiers
    trace the call belongs to (the X-Session-ID header verifiers' client sends on every call of a rollout)."""
    router = APIRouter()

    @router.post("/verifiers/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody, request: Request) -> Any:
        trace = request.headers.get("x-session-id")
        if not trace:
            raise ApiError(400, "X-Session-ID: a verifiers client names the trace of each call; none was sent")
        answer = await request.app.state.completer.chat(body, request, trace)
        return JSONResponse(answer) if isinstance(answer, dict) else answer

    return router


def build_verifiers(cfg: Any, engine: Any, tokenizer: Any) -> VerifiersRollout:
    """The rollout of an `RLConfig`'s `env.verifiers` over `engine` (the run's, or a producer's placed one)."""
    from tokenmill.envs.verifiers_env import load_cached

    env = cfg.env
    return VerifiersRollout(load_cached(env.verifiers, env.kwargs), engine, tokenizer,
                            SamplingParams.from_config(cfg.generation), max_concurrent=env.max_concurrent,
                            timeout_s=max(env.step_timeout_s, 1.0) * env.max_turns, seed=cfg.training.seed)
