"""Per-step rollout metrics and the greedy held-out evaluation."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from tokenmill.controller.at_k import answer_extractor, at_k_metrics
from tokenmill.envs.metrics import episode_metrics, succeeded
from tokenmill.rollout.agent import AgentLoop, build_agent
from tokenmill.rollout.generator import Generator, build_generator
from tokenmill.types import Group, Sample, StopReason, TokenmillError

ACCURACY_THRESHOLD = 1.0 - 1e-6  # a task reward of 1.0 means "solved"
EVAL_SEED_OFFSET = 20_000  # evaluation samples from training.seed + this: a stream of its own


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def _success(sample: Sample, accuracy_reward: str | None) -> bool:
    """A built-in task's verifier scoring 1.0 where the sample has one, else the env's word or a total of 1.0."""
    if accuracy_reward is not None and accuracy_reward in sample.rewards:
        value = sample.rewards[accuracy_reward]
        return value is not None and value >= ACCURACY_THRESHOLD
    return succeeded(sample, ACCURACY_THRESHOLD)


def rollout_metrics(groups: list[Group], accuracy_reward: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Reward (total and per function), accuracy, lengths, stop reasons; plus distinct reward errors. accuracy:
    the share of samples `accuracy_reward` (a built-in task's verifier) scores 1.0; without one, of episodes the
    environment reports solved, or of totals reaching 1.0."""
    samples = [s for g in groups for s in g.samples]
    m: dict[str, Any] = {}
    valid = [s.reward for s in samples if not math.isnan(s.reward)]
    m["reward/mean"], m["reward/std"] = _mean_std(valid)
    m["reward/unscored"] = len(samples) - len(valid)
    m["accuracy"] = sum(_success(s, accuracy_reward) for s in samples) / max(1, len(samples))
    m |= episode_metrics(samples)  # env/turns, env/solved, env/<info key>
    names = samples[0].rewards.keys() if samples else []
    errors: Counter[str] = Counter()
    for name in names:
        vals = [s.rewards[name] for s in samples if s.rewards.get(name) is not None]
        m[f"reward/{name}/mean"], m[f"reward/{name}/std"] = _mean_std(vals)
        failed = [s.reward_errors[name] for s in samples if name in s.reward_errors]
        m[f"reward/{name}/failed"] = len(failed)
        errors.update(f"reward {name!r} failed: {e}" for e in failed)
    lengths = [s.completion_len for s in samples]
    m["response_len/mean"] = statistics.fmean(lengths) if lengths else 0.0
    m["response_len/max"] = max(lengths, default=0)
    m["response_len/clip_ratio"] = sum(s.stop_reason is StopReason.LENGTH for s in samples) / max(1, len(samples))
    flat = sum(1 for g in groups if len({s.reward for s in g.samples}) == 1)
    m["groups/zero_variance_fraction"] = flat / max(1, len(groups))
    return m, [f"{e} (x{n})" for e, n in errors.most_common(3)]


MAX_LOGGED_TOKENS = 2048  # per logged sample: samples.jsonl stays a few kilobytes a line
LOGPROB_DECIMALS = 5  # 1e-5 is finer than anything the token view shows, and keeps a number to ~9 characters


def sample_records(groups, k: int, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The first `k` samples of a step as JSON records (samples.jsonl). `advantage` is the one the sample
    trained with (with a critic: the mean of its per-token advantages over the trained tokens); `extras`, where
    a reward logged any, what it logged for the sample (`log_extra`: an extracted answer, say). With the run's
    `tokenizer`, `tokens`: the completion token by token, `[text, logprob]` each (the sampler's logprob, the
    one the trainer's ratio starts from; null for a token the policy did not write, e.g. an environment's)."""
    picked = [s for g in groups for s in g.samples][:k]
    return [
        {"prompt": s.prompt, "completion": s.completion, "reward": s.reward, "rewards": s.rewards,
         "advantage": _advantage(s), "stop": s.stop_reason.value} | ({"extras": s.extras} if s.extras else {})
        | ({"tokens": token_records(s, tokenizer)} if tokenizer is not None else {})
        for s in picked
    ]


def token_records(s: Sample, tokenizer: Any) -> list[list[Any]]:
    """The completion's tokens as `[text, logprob]` (logprob rounded, null where the token is not trained)."""
    start, end = s.prompt_len, min(len(s.tokens), s.prompt_len + MAX_LOGGED_TOKENS)
    return [[tokenizer.decode([s.tokens[i]]), round(s.logprobs[i], LOGPROB_DECIMALS) if s.loss_mask[i] else None]
            for i in range(start, end)]


def _advantage(s: Sample) -> float:
    if not s.token_advantages:
        return s.advantage
    trained = [a for a, m in zip(s.token_advantages, s.loss_mask, strict=True) if m]
    return statistics.fmean(trained) if trained else 0.0


def evaluate(
    generator: Generator, rows, max_rows: int, chunk: int = 256, accuracy_reward: str | None = None
) -> dict[str, float]:
    """Greedy decoding on held-out rows: mean total reward, each reward's mean, and accuracy: the share of rows
    whose `accuracy_reward` (a built-in task's verifier) scores 1.0, or whose total does when none is named."""
    params = replace(generator.params, n=1, greedy=True)
    rows = [rows[i] for i in range(min(len(rows), max_rows))]
    samples = [s for g in scored_groups(generator, rows, params, chunk) for s in g.samples]
    totals = [s.reward for s in samples]
    valid = [t for t in totals if not math.isnan(t)]
    out = {"eval/reward_mean": statistics.fmean(valid) if valid else math.nan}
    for name in dict.fromkeys(k for s in samples for k in s.rewards):
        scores = [v for s in samples if (v := s.rewards.get(name)) is not None]
        out[f"eval/reward/{name}"] = statistics.fmean(scores) if scores else math.nan
    hits = [s.rewards.get(accuracy_reward) if accuracy_reward else s.reward for s in samples]
    out["eval/accuracy"] = sum(h is not None and h >= ACCURACY_THRESHOLD for h in hits) / max(1, len(samples))
    out["eval/rows"] = len(samples)
    return out


def scored_groups(generator: Generator, rows: list, params, chunk: int = 256) -> list[Group]:
    """`params.n` samples of each row, scored by the generator's rewards, `chunk` rows per engine batch."""
    groups: list[Group] = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        prompt_ids, completions = generator.sample(part, params)
        groups += generator.score(part, prompt_ids, completions, version=0)
    return groups


def evaluate_agent(agent, rows, max_rows: int) -> dict[str, float]:
    """Held-out episodes, one per row: greedy, and sampled as in training. accuracy is the share of episodes
    the environment reports solved (`info["solved"]`; without it, whose return reaches 1.0); failed episodes
    count as unsolved. Policy turns per episode are eval/[sampled_]env/turns, the environment's info numbers
    eval/[sampled_]env/<key>."""
    rows = [rows[i] for i in range(min(len(rows), max_rows))]
    out: dict[str, float] = {"eval/rows": len(rows)}
    for tag, params in (("", replace(agent.params, n=1, greedy=True)), ("sampled_", None)):
        groups, _ = agent.rollout(rows, group_size=1, params=params)
        returns = [s.reward for g in groups for s in g.samples]
        valid = [r for r in returns if not math.isnan(r)]
        out[f"eval/{tag}reward_mean"] = statistics.fmean(valid) if valid else math.nan
        samples = [s for g in groups for s in g.samples]
        out[f"eval/{tag}accuracy"] = sum(succeeded(s, ACCURACY_THRESHOLD) for s in samples) / max(1, len(returns))
        out |= episode_metrics(samples, prefix=f"eval/{tag}env/")
    return out


def _plays_episodes(player) -> bool:
    """The agent loop, or a rollout that plays its own episodes (a verifiers environment's)."""
    return isinstance(player, AgentLoop) or getattr(player, "plays_episodes", False)


def evaluate_player(player: Generator | AgentLoop, rows, cfg) -> dict[str, float]:
    """A run's held-out evaluation with its evaluator (`RolloutSide.evaluator`): episodes through the agent loop
    (`evaluate_agent`), or greedy samples of the generator scored by its rewards (`evaluate`); accuracy is the
    built-in task's verifier where there is one. With `controller.eval_samples`, the sampled metrics too
    (`evaluate_at_k`). Whatever samples draws from its own seeded stream (`pinned_sampling`), so the numbers
    depend on the weights and the rows only: `tokenmill eval` of a checkpoint gives the run's."""
    seed = cfg.training.seed + EVAL_SEED_OFFSET
    if _plays_episodes(player):
        with pinned_sampling(getattr(player, "engine", None), seed):
            out = evaluate_agent(player, rows, cfg.controller.eval_max_rows)
    else:
        out = evaluate(player, rows, cfg.controller.eval_max_rows, accuracy_reward=cfg.data.task)
    if cfg.controller.eval_samples:
        with pinned_sampling(getattr(player, "engine", None), seed + 1):
            out |= evaluate_at_k(player, rows, cfg)
    return out


def evaluate_at_k(player: Generator | AgentLoop, rows, cfg) -> dict[str, float]:
    """`controller.eval_samples` samples (episodes) per held-out row at `controller.eval_temperature`:
    eval/pass@k, eval/maj@k, eval/avg@n (`controller.at_k`). Correct means what greedy accuracy counts: the
    task's verifier scoring 1.0, else the environment's `solved`, else a total reward of 1.0."""
    c = cfg.controller
    rows = [rows[i] for i in range(min(len(rows), c.eval_max_rows))]
    temperature = cfg.generation.temperature if c.eval_temperature is None else c.eval_temperature
    params = replace(player.params, n=c.eval_samples, greedy=False, temperature=temperature)
    if _plays_episodes(player):
        groups, _ = player.rollout(rows, group_size=c.eval_samples, params=params)
    else:
        groups = scored_groups(player, rows, params)
    extract = answer_extractor(c.eval_answer, cfg.data.task)
    return at_k_metrics(groups, c.eval_ks, lambda s: _success(s, cfg.data.task), extract)


@contextmanager
def pinned_sampling(engine, seed: int) -> Iterator[None]:
    """Sample from a stream seeded with `seed` inside, and give the engine its own stream back after: an
    evaluation neither depends on nor moves the training's sampling. Engines that sample elsewhere (servers)
    are left as they are."""
    rng = getattr(engine, "generator", None)
    if not isinstance(rng, torch.Generator):
        yield
        return
    saved = rng.get_state()
    rng.manual_seed(seed)
    try:
        yield
    finally:
        rng.set_state(saved)


def evaluate_config(cfg, engine, tokenizer, rewards, rows) -> dict[str, float]:
    """The held-out evaluation a run of `cfg` does on `rows` (`tokenmill eval`): episodes of `cfg.env` through
    the agent loop where it has one, else greedy samples scored by `rewards` (`evaluate_player`). Raises
    `TokenmillError` with the reason when a number comes out NaN (nothing was scored)."""
    if cfg.env is not None:
        player: Generator | AgentLoop = build_agent(cfg, engine, tokenizer)
        why = "every episode failed (the environment raised, timed out or the engine failed)"
    else:
        player = build_generator(cfg, engine, tokenizer, rewards)
        why = "no sample got a reward (each reward failed or returned NaN on every row)"
    try:
        result = evaluate_player(player, rows, cfg)
    finally:
        if getattr(player, "plays_episodes", False):  # a VerifiersRollout: its server and serving engine
            player.close()
    nan = [k for k, v in result.items() if isinstance(v, float) and math.isnan(v)]
    if nan:
        raise TokenmillError(f"eval: {', '.join(nan)} is NaN on {result['eval/rows']} rows: {why}")
    return result
