"""The agent loop: many multi-turn episodes against environments, their pending turns batched together.

Each round, every live episode that waits for the policy is put in one engine batch; the sampled turns go
to their environments concurrently (each `step` with a timeout); episodes that end leave, and queued
episodes take their places at once, so the engine batch stays full and a short episode never waits for a
long one (continuous batching at the turn level).

Token truth: an episode's token ids are the prompt's (the chat template applied to `reset`'s messages), then
for each turn exactly the ids the engine sampled (loss mask 1, with their logprobs), then the tokens the
chat template puts between that turn and the next (the end-of-turn suffix, the observation messages and the
next generation prompt; loss mask 0). The observation tokens are the template's rendering of the history
plus the observation minus the rendering of the history alone, so re-applying the template to the final
messages gives the same ids; sampled tokens are never re-tokenized.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.data.chat import ChatTemplateError
from tokenmill.engines.local.routing import extend_routes, fit_routes
from tokenmill.envs.base import EnvFactory, Message, as_messages, as_step_result, call
from tokenmill.tracking.stages import stage
from tokenmill.types import Completion, ConfigError, Group, Sample, SamplingParams, StopReason

log = logging.getLogger("tokenmill.agent")


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 8  # policy turns per episode
    max_episode_tokens: int = 1024  # prompt + every turn + every observation
    step_timeout_s: float = 30.0  # one reset / step / close
    max_concurrent: int = 256  # live episodes (the engine batch is at most this)
    end_on_truncation: bool = True  # a turn cut at max_tokens ends the episode (else it is closed and goes on)
    # > 0: an engine call holds histories of at least this share of its longest (for engines that re-read
    # every history; with a prefix cache only new tokens are read, so one call per turn budget is best)
    length_ratio: float = 0.0


class ChatFormat:
    """The chat template's token deltas: the prompt of a conversation and what follows a sampled turn."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id])

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m.get("content") or ""} for m in messages],
            tokenize=False, add_generation_prompt=generation_prompt, tools=self.tools,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        return self.encode(self.render(messages, True))

    def after_turn(self, history: Sequence[Message], observation: Sequence[Message], ended_with_eos: bool) -> list[int]:
        """Tokens between a sampled turn (the last message of `history`) and the next one: the rest of the
        template's end of that turn, the observation, and the next generation prompt."""
        base = self.render(history, False)
        full = self.render([*history, *observation], True)
        if not full.startswith(base):
            raise ChatTemplateError("the chat template rewrites earlier turns; multi-turn token deltas are undefined")
        # the sampled ids end with the eos token: what the template writes after it (e.g. a newline) follows;
        # a turn cut at max_tokens gets the template's end-of-turn, eos included (not trained)
        end = base.rfind(self.eos_text)
        cut = len(base) if end < 0 else end + (len(self.eos_text) if ended_with_eos else 0)
        return self.encode(base[cut:] + full[len(base) :])


@dataclass
class AgentEpisode:
    """One episode the agent loop runs against an environment: its messages and token truth so far."""

    index: int
    group: int
    task: dict[str, Any]
    env: Any = None
    messages: list[Message] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    turn_rewards: list[float] = field(default_factory=list)
    calls: list[tuple[tuple[int, ...], Completion]] = field(default_factory=list)  # step-wise: (prompt ids, turn)
    routes: Any = None  # router replay r3: the MoE routing of `tokens` as the engine read them (`extend_routes`)
    info: dict[str, Any] = field(default_factory=dict)
    stop: StopReason = StopReason.STOP
    error: str | None = None
    done: bool = False
    started: float = 0.0
    finished: float = 0.0

    @property
    def reward(self) -> float:
        return math.nan if self.error else math.fsum(self.turn_rewards)


@dataclass
class AgentStats:
    engine_calls: int = 0
    rounds: int = 0  # one per turn of all live episodes (one or more engine calls)
    engine_rows: int = 0  # sum over rounds of the live episodes
    engine_seconds: float = 0.0
    env_seconds: float = 0.0
    episodes: int = 0
    failed: int = 0

    def report(self, max_concurrent: int) -> dict[str, float]:
        """Metrics; occupancy is against the slots the run could fill (fewer episodes than slots fill fewer)."""
        slots = min(max_concurrent, self.episodes) if self.episodes else max_concurrent
        return {
            "agent/engine_calls": self.engine_calls,
            "agent/rounds": self.rounds,
            "agent/batch_occupancy": self.engine_rows / max(1, self.rounds * slots),
            "agent/mean_batch": self.engine_rows / max(1, self.rounds),
            "agent/engine_s": self.engine_seconds,
            "agent/env_s": self.env_seconds,
            "agent/failed_episodes": self.failed,
        }


def parse_turn(text: str, parser: Callable[[str], Any] | None) -> Message:
    """The assistant message an environment sees: the sampled text, plus `tool_calls` (OpenAI form) and any
    parse errors when a tool-call parser is given."""
    message: Message = {"role": "assistant", "content": text}
    if parser is not None:
        parsed = parser(text)
        if parsed.tool_calls:
            message["tool_calls"] = [c.openai() for c in parsed.tool_calls]
        if parsed.errors:
            message["tool_call_errors"] = list(parsed.errors)
    return message


class AgentLoop:
    """Runs episodes of `env_factory` environments with `engine`; returns one Group per task."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env_factory: EnvFactory,
        params: SamplingParams,
        limits: AgentLimits = AgentLimits(),
        tool_parser: Callable[[str], Any] | None = None,
        tools: list[dict] | None = None,
        stepwise: bool = False,
    ) -> None:
        self.engine = engine
        # one sample per model call, its prompt the chat template's rendering of the conversation as it stands
        # (which may have been rewritten), instead of one token sequence per episode
        self.stepwise = stepwise
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.params = params
        self.limits = limits
        self.tool_parser = tool_parser
        self.format = ChatFormat(tokenizer, tools)
        self.stats = AgentStats()

    # ------------------------------------------------------------------------------------------ public
    def rollout(
        self, rows: Sequence[dict[str, Any]], version: int = 0, first_group: int = 0, *,
        group_size: int | None = None, params: SamplingParams | None = None,
    ) -> tuple[list[Group], dict[str, float]]:
        """`group_size` episodes per row (default: the sampling params' n), all run to the end (the `Rollout`
        protocol; timed as the generate stage, whose tokens are the policy's); the info is the loop's stats."""
        g = group_size or self.params.n
        self.stats = AgentStats()
        with stage("generate") as t:
            episodes = asyncio.run(self.run([(row, i) for i, row in enumerate(rows) for _ in range(g)], params))
            if t is not None:
                t.add_tokens("generate", sum(sum(ep.mask) for ep in episodes))
        groups: dict[int, list[Sample]] = {}
        for ep in episodes:
            samples = self.step_samples(ep, version, first_group) if self.stepwise and ep.calls else \
                [self.to_sample(ep, version, first_group)]
            groups.setdefault(ep.group, []).extend(samples)
        out = [Group(first_group + i, tuple(groups[i])) for i in range(len(rows))]
        return out, self.stats.report(self.limits.max_concurrent)

    async def run(
        self, queue: Sequence[tuple[dict[str, Any], int]], params: SamplingParams | None = None
    ) -> list[AgentEpisode]:
        """Run an episode for each (task, group) of `queue`, at most `max_concurrent` at a time; a finished
        episode's place goes to the next queued one before the next engine batch."""
        params = replace(params or self.params, n=1)
        waiting = deque(AgentEpisode(i, grp, dict(task)) for i, (task, grp) in enumerate(queue))
        live: list[AgentEpisode] = []
        done: list[AgentEpisode] = []
        while waiting or live:
            starting = []
            while waiting and len(live) + len(starting) < self.limits.max_concurrent:
                starting.append(waiting.popleft())
            await self._gather([self._start(ep) for ep in starting])
            live += starting
            await self._retire(live, done)
            if not live:
                continue
            turns = self._generate(live, params)
            await self._gather([self._step(ep, turn) for ep, turn in zip(live, turns, strict=True)])
            await self._retire(live, done)
        return sorted(done, key=lambda e: e.index)

    async def _retire(self, live: list[AgentEpisode], done: list[AgentEpisode]) -> None:
        """Move finished episodes out of `live` and close their environments."""
        finished = [e for e in live if e.done]
        now = time.perf_counter()
        for ep in finished:
            live.remove(ep)
            ep.finished = now
            done.append(ep)
        self.stats.episodes += len(finished)
        await self._gather([self._close(ep) for ep in finished])

    # ------------------------------------------------------------------------------------------ steps
    async def _gather(self, coros: list) -> None:
        if coros:
            start = time.perf_counter()
            await asyncio.gather(*coros)
            self.stats.env_seconds += time.perf_counter() - start

    async def _timed(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wait_for(call(fn, *args), timeout=self.limits.step_timeout_s)

    def _fail(self, ep: AgentEpisode, what: str, exc: BaseException) -> None:
        if isinstance(exc, asyncio.TimeoutError | TimeoutError):
            reason = f"{what} timed out after {self.limits.step_timeout_s:g}s"
        else:
            reason = f"{what} failed: {type(exc).__name__}: {exc}"
        ep.error, ep.done, ep.stop = reason, True, StopReason.ERROR
        self.stats.failed += 1
        log.warning("episode %d (task group %d): %s", ep.index, ep.group, reason)

    async def _start(self, ep: AgentEpisode) -> None:
        ep.started = time.perf_counter()
        try:
            ep.env = self.env_factory()
            ep.messages = as_messages(await self._timed("reset", ep.env.reset, ep.task))
            ep.tokens = self.format.prompt(ep.messages)
        except Exception as exc:  # noqa: BLE001 - a broken environment fails its episode, not the run
            self._fail(ep, "reset", exc)
            return
        ep.prompt_len = len(ep.tokens)
        ep.mask = [0] * len(ep.tokens)
        ep.logprobs = [0.0] * len(ep.tokens)
        if ep.prompt_len >= self.limits.max_episode_tokens:
            ep.done, ep.stop = True, StopReason.LENGTH

    def _generate(self, live: list[AgentEpisode], params: SamplingParams) -> list[Completion]:
        """One turn for every live episode, batched; an episode near its token budget gets a shorter turn."""
        start = time.perf_counter()
        budgets = [min(params.max_tokens, self.limits.max_episode_tokens - len(ep.tokens)) for ep in live]
        out: list[Completion | None] = [None] * len(live)
        for idx in self._buckets(live, budgets):
            budget = budgets[idx[0]]
            results = self.engine.generate([live[i].tokens for i in idx], replace(params, max_tokens=budget))
            for i, group in zip(idx, results, strict=True):
                out[i] = group[0]
            self.stats.engine_calls += 1
        self.stats.rounds += 1
        self.stats.engine_rows += len(live)
        self.stats.engine_seconds += time.perf_counter() - start
        return out  # type: ignore[return-value]

    def _buckets(self, live: list[AgentEpisode], budgets: list[int]) -> list[list[int]]:
        """Engine calls for one round: episodes with the same turn budget, cut by context length so that no
        call pads a short history to a long one's length (a row shorter than `length_ratio` x the call's
        longest starts a new call); the engine re-reads each history, so padding costs real compute."""
        calls: list[list[int]] = []
        for budget in sorted(set(budgets), reverse=True):
            idx = sorted((i for i, b in enumerate(budgets) if b == budget), key=lambda i: -len(live[i].tokens))
            current: list[int] = []
            for i in idx:
                if current and len(live[i].tokens) < self.limits.length_ratio * len(live[current[0]].tokens):
                    calls.append(current)
                    current = []
                current.append(i)
            calls.append(current)
        return calls

    async def _step(self, ep: AgentEpisode, turn: Completion) -> None:
        ep.turns += 1
        if self.stepwise:
            ep.calls.append((tuple(ep.tokens), turn))
        elif turn.routes is not None:
            ep.routes = extend_routes(ep.routes, turn.routes)
        ep.tokens += turn.token_ids
        ep.mask += [1] * len(turn.token_ids)
        ep.logprobs += turn.logprobs
        message = parse_turn(turn.text, self.tool_parser)
        ep.messages.append(message)
        if turn.stop_reason is StopReason.ERROR:
            self._fail(ep, "generate", RuntimeError("the engine failed on this turn"))
            return
        try:
            result = as_step_result(await self._timed("step", ep.env.step, message))
        except Exception as exc:  # noqa: BLE001
            self._fail(ep, "step", exc)
            return
        ep.turn_rewards.append(result.reward)
        ep.info.update(result.info)
        if result.done:
            ep.done = True
            return
        truncated = turn.stop_reason is StopReason.LENGTH
        if truncated and self.limits.end_on_truncation:  # cut mid-turn: by default the episode ends there
            ep.done, ep.stop = True, StopReason.LENGTH
            return
        if ep.turns >= self.limits.max_turns:
            ep.done, ep.stop = True, StopReason.LENGTH
            ep.info["turn_limit"] = True
            return
        if not self._next_context(ep, result, truncated):
            return
        if len(ep.tokens) >= self.limits.max_episode_tokens:
            ep.done, ep.stop = True, StopReason.LENGTH
            ep.info["token_limit"] = True

    def _next_context(self, ep: AgentEpisode, result: Any, truncated: bool) -> bool:
        """Extend the episode with the observation: its template tokens after the turn (one growing sequence),
        or step-wise the whole conversation rendered again (the history as the environment may have rewritten
        it). False when the episode failed here."""
        if self.stepwise:
            ep.messages = [*(ep.messages if result.history is None else result.history), *result.observation]
            try:
                ep.tokens = self.format.prompt(ep.messages)
            except Exception as exc:  # noqa: BLE001 - a message the template cannot render fails the episode
                self._fail(ep, "chat template", exc)
                return False
            ep.mask, ep.logprobs = [0] * len(ep.tokens), [0.0] * len(ep.tokens)
            return True
        if result.history is not None:
            self._fail(ep, "step", ValueError("the environment rewrote the history (StepResult.history); one "
                                              "token sequence cannot hold that: set env.stepwise: true"))
            return False
        try:
            delta = self.format.after_turn(ep.messages, result.observation, ended_with_eos=not truncated)
        except ChatTemplateError as exc:
            self._fail(ep, "chat template", exc)
            return False
        ep.messages += result.observation
        ep.tokens += delta
        ep.mask += [0] * len(delta)
        ep.logprobs += [0.0] * len(delta)
        return True

    async def _close(self, ep: AgentEpisode) -> None:
        if ep.env is None or not hasattr(ep.env, "close"):
            return
        try:
            await self._timed("close", ep.env.close)
        except Exception as exc:  # noqa: BLE001 - a failed close loses nothing of the episode
            log.warning("episode %d: close failed: %s: %s", ep.index, type(exc).__name__, exc)

    # ------------------------------------------------------------------------------------------ samples
    def to_sample(self, ep: AgentEpisode, version: int, first_group: int = 0) -> Sample:
        """The episode as a trainable Sample (its messages, turns and info in `row`)."""
        tokens = ep.tokens or [self.tokenizer.eos_token_id]
        return Sample(
            tokens=tuple(tokens), loss_mask=tuple(ep.mask or [0]), logprobs=tuple(ep.logprobs or [0.0]),
            prompt_len=ep.prompt_len, prompt=ep.task.get("prompt", ep.messages[:2]),
            completion=self.tokenizer.decode(tokens[ep.prompt_len :]), stop_reason=ep.stop, version=version,
            group_id=first_group + ep.group, reward=ep.reward, rewards={"env": None if ep.error else ep.reward},
            reward_errors={"env": ep.error} if ep.error else {},
            row={**ep.task, "messages": ep.messages, "turns": ep.turns, "info": ep.info},
            routes=None if ep.routes is None else fit_routes(ep.routes, len(tokens)),
        )


    def step_samples(self, ep: AgentEpisode, version: int, first_group: int = 0) -> list[Sample]:
        """Step-wise (`env.stepwise`): one Sample per model call, exactly the ids the engine read and sampled,
        each with the episode's return as its reward and `episode` set so that they share one advantage; the
        call's own reward is in `row["step_reward"]`."""
        whole = self.to_sample(ep, version, first_group)
        out = []
        for k, (prompt, turn) in enumerate(ep.calls):
            n = len(turn.token_ids)
            step_reward = ep.turn_rewards[k] if k < len(ep.turn_rewards) else math.nan
            out.append(whole.with_(
                tokens=prompt + turn.token_ids, loss_mask=(0,) * len(prompt) + (1,) * n,
                logprobs=(0.0,) * len(prompt) + turn.logprobs, prompt_len=len(prompt), completion=turn.text,
                stop_reason=StopReason.ERROR if ep.error else turn.stop_reason, episode=ep.index,
                row={**whole.row, "step": k, "step_reward": step_reward}, routes=turn.routes,
            ))
        return out


def build_agent(cfg: Any, engine: Any, tokenizer: Any) -> AgentLoop:
    """The agent loop for an `RLConfig`'s `env`: a factory for local or remote environments, the engine, the
    limits; an environment that exposes `tools` (a registry) gets their specs in the chat template and its
    calls parsed."""
    env = cfg.env
    if env.stepwise and env.verifiers is not None:
        raise ConfigError("env.stepwise: a verifiers environment builds its own samples; step-wise training is "
                          "for the agent loop's environments (env.name, env.url, env.openenv)")
    if env.verifiers is not None:  # a verifiers environment plays its own episodes (rollout/verifiers_rollout.py)
        from tokenmill.rollout.verifiers_rollout import build_verifiers

        return build_verifiers(cfg, engine, tokenizer)
    if env.url is not None:
        from tokenmill.envs.remote import remote_factory

        factory = remote_factory(env.url, token=env.token or os.environ.get("TOKENMILL_ENV_TOKEN"),
                                 timeout_s=env.step_timeout_s)
        tools, parser = None, None
    elif env.openenv is not None:
        from tokenmill.envs.openenv import openenv_factory

        factory = openenv_factory(env.openenv, env.kwargs, timeout_s=env.step_timeout_s,
                                  max_concurrent=env.max_concurrent)
        tools, parser = None, None
    else:
        from tokenmill.envs import resolve_env
        from tokenmill.envs.tools import HermesToolCallParser

        factory = resolve_env(env.name, env.kwargs)
        try:
            probe = factory()
        except Exception as exc:  # noqa: BLE001 - a constructor that fails is a config problem, reported as one
            raise ConfigError(f"env.kwargs: cannot create {env.name!r}: {type(exc).__name__}: {exc}") from None
        registry = getattr(probe, "tools", None)
        tools = registry.specs() if registry is not None else None
        parser = HermesToolCallParser().parse if registry is not None else None
    if hasattr(engine, "enable_prefix_cache"):
        engine.enable_prefix_cache(int(env.prefix_cache_mb * 2**20 // engine.kv_bytes_per_token()))
    # a served OpenEnv class may hold fewer sessions (episodes) at once than env.max_concurrent
    live = min(env.max_concurrent, getattr(factory, "max_sessions", None) or env.max_concurrent)
    limits = AgentLimits(max_turns=env.max_turns, max_episode_tokens=env.max_episode_tokens,
                         step_timeout_s=env.step_timeout_s, max_concurrent=live)
    if getattr(engine, "takes_images", False):  # a vision-language policy: observations may hold images
        from tokenmill.engines.local.vision import VisionProcessor
        from tokenmill.rollout.vision_agent import build_vision_agent

        processor = VisionProcessor.from_pretrained(cfg.model.path, tokenizer=tokenizer)
        return build_vision_agent(cfg, engine, processor, factory, limits, tool_parser=parser, tools=tools)
    return AgentLoop(engine, tokenizer, factory, SamplingParams.from_config(cfg.generation), limits,
                     tool_parser=parser, tools=tools, stepwise=env.stepwise)
