"""The synchronous RL loop, top to bottom: sample -> generate -> score -> advantages -> train -> sync -> log
-> checkpoint. Everything it calls is built in `build.py`; timing goes through `stage()`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from tokenmill.algorithms.advantages import assign_advantages
from tokenmill.algorithms.shaping import has_spread, shape_overlong
from tokenmill.checkpoint.atomic import (
    checkpoint_name,
    load_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from tokenmill.checkpoint.export import export_atomic
from tokenmill.checkpoint.fingerprint import resume_check, run_fingerprint
from tokenmill.checkpoint.preempt import Preemption
from tokenmill.config.schema import RLConfig
from tokenmill.controller.build import RolloutSide, Run
from tokenmill.controller.evaluate import evaluate_player, rollout_metrics, sample_records
from tokenmill.controller.feeds import Feed, rollout_feed
from tokenmill.health.monitors import health_monitors
from tokenmill.health.report import efficiency_metrics
from tokenmill.tracking.stages import stage, step_timer
from tokenmill.training.critic import gae_advantages
from tokenmill.training.dist import barrier, is_main, max_over_ranks
from tokenmill.training.model import parameter_counts
from tokenmill.training.spec import zero_mismatch
from tokenmill.training.teacher import distill_groups
from tokenmill.training.update import UpdateWatch, policy_update, value_update
from tokenmill.types import ConfigError, Group, Sample


def run_rl(run: Run) -> dict[str, Any]:
    """Train until `controller.steps`; return the first and last evaluation and the last step's metrics."""
    cfg, log = run.cfg, run.logger
    announce(run)
    start, buffered = resume(run) if cfg.checkpoint.resume else (0, {})
    # killed after the last checkpoint but before the export: the export and final eval are still owed
    owed = cfg.checkpoint.save_final and not (run.output_dir / "final").is_dir()
    if start >= cfg.controller.steps:
        log.message(f"checkpoint is at step {start} of {cfg.controller.steps}: nothing left to train"
                    + ("; writing the final export it still owes" if owed else ""))
    result: dict[str, Any] = {"resumed_from": start}
    if run.eval_rows is not None and start == 0:
        result["eval_before"] = run.eval_before = held_out(run)
        log.log(0, result["eval_before"])
    metrics: dict[str, Any] = {}
    end = last = cfg.controller.steps  # the run's last step, and this process's (max_steps_per_run)
    if cfg.controller.max_steps_per_run:
        last = min(last, start + cfg.controller.max_steps_per_run)
    # generation runs in place (colocated), ahead in a producer (at most controller.max_staleness versions),
    # or in an external agent program (proxy): the feed hides which
    # health (cfg.health, run.monitors): the probe, the mismatch, the efficiency report and the alarms
    # signals (checkpoint/preempt.py): SIGTERM and Ctrl-C save at the next step boundary and stop, SIGUSR1 saves
    with (preemption(run) as preempt, rollout_feed(run, partial(rollout, cfg), start, buffered) as feed,
          health_monitors(run, feed, save=lambda s: save(run, s, feed)) as monitors):
        for step in range(start + 1, last + 1):
            with step_timer(step, side=feed.side) as timer:
                # 1-3. sample prompts, generate G completions each (all groups in one engine batch), score them
                got = feed.get(step)
                if got is None:  # no more rollouts will come (a proxy agent exited): the run ends here
                    end = last = step - 1
                    break
                groups, sampling = got
                # 4. advantages: inside each group (GRPO family), or per token from the critic's values (PPO)
                groups, samples, train_metrics = advantages(run, groups)
                # 5. policy update (reference forward included when KL is in the loss), then the critic's
                train_metrics |= update(run, step, samples, monitors.watch_update(step))
                # 6. sync weights to the engine (a version bump when it shares the module)
                with stage("sync"):
                    feed.push(step)
                    train_metrics |= monitors.after_push(step)
            # 7. log (the samples with the advantages they were trained with)
            metrics = log_step(run, step, groups, sampling | train_metrics, timer)
            monitors.after_step(step, metrics, groups)
            # 8. checkpoint: every checkpoint.every steps, and when a signal asked (after SIGTERM / SIGINT: stop)
            asked = preempt.asked(step)
            if step < last and (asked or cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                preempt.saved(step, save(run, step, feed))
    if last < end:
        save(run, last, feed)
        log.message(f"stopped after step {last} of {end} (max_steps_per_run); resume to go on")
        result["last_metrics"] = metrics
        return result
    trained = start < end
    if cfg.checkpoint.save_final and trained:
        save(run, end, feed)
    if (owed or (cfg.checkpoint.save_final and trained)) and is_main():
        export_atomic(run.trainer.model, run.tokenizer, run.output_dir / "final")
    if run.eval_rows is not None and (trained or owed):
        result["eval_after"] = held_out(run)
        log.log(end, result["eval_after"])
    result["last_metrics"] = metrics
    return result


def announce(run: Run) -> None:
    """What one step is, and how much of the model trains."""
    cfg = run.cfg
    seqs = cfg.sequences_per_step
    run.logger.message(
        f"{cfg.controller.prompts_per_step} prompts x {cfg.generation.group_size} samples = {seqs} sequences "
        f"per step; {cfg.algorithm.ppo_epochs} epoch(s) x {cfg.algorithm.mini_batches} mini-batch(es) = "
        f"{cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches} optimiser step(s) per step"
    )
    trainable, total = parameter_counts(run.trainer.model)
    run.logger.message(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(1, total):.2f}%)")


def held_out(run: Run) -> dict[str, float]:
    """Greedy evaluation on the held-out rows with the rollout side's evaluator (`evaluate.evaluate_player`)."""
    return evaluate_player(run.rollout.evaluator, run.eval_rows, run.cfg)


def advantages(run: Run, groups: list[Group]) -> tuple[list[Group], list[Sample], dict[str, float]]:
    """The groups with their advantages set (what samples.jsonl logs), the trainable samples among them, and
    any metrics of computing them."""
    algo, trainer, pad_id = run.cfg.algorithm, run.trainer, run.rollout.engine.pad_id
    if trainer.teacher is not None:  # on-policy distillation: minus the reverse KL to the teacher, per token
        # with the full KL in the trainer's loss (its spec says), the advantages carry the task's share only
        with stage("teacher"):
            return distill_groups(groups, trainer.teacher, run.cfg.distillation, scale_rewards=algo.scale_rewards,
                                  student=trainer.model, temperature=run.cfg.generation.temperature,
                                  pad_id=pad_id, full=trainer.spec.distill is not None)
    if trainer.critic is None:
        groups = assign_advantages(groups, algo.advantage, scale_rewards=algo.scale_rewards)
        return groups, [s for g in groups for s in g.samples if s.trainable], {}
    samples = [s for g in groups for s in g.samples if s.trainable]
    if not samples:
        return groups, [], {}
    with stage("critic"):
        samples, metrics = gae_advantages(samples, trainer.critic, algo, pad_id=pad_id, reference=trainer.reference)
    scored = iter(samples)  # in the order they were taken: put them back in their groups
    groups = [Group(g.group_id, tuple(next(scored) if s.trainable else s for s in g.samples)) for g in groups]
    return groups, samples, metrics


def update(run: Run, step: int, samples: list[Sample], watch: UpdateWatch | None = None) -> dict[str, float]:
    """The policy update (none while the critic warms up), then the critic's; their metrics (the `watch`'s
    among them: a health monitor's view of the policy update)."""
    cfg, trainer, metrics = run.cfg, run.trainer, {}
    pad_id = run.rollout.engine.pad_id
    if cfg.record.rollout_only:  # generate and score (and dump) only
        return metrics
    if samples and (trainer.critic is None or step > cfg.critic.warmup_steps):
        with stage("train") as t:
            metrics |= policy_update(
                samples, trainer.backend, cfg.algorithm, pad_id=pad_id, max_tokens=cfg.generation.max_tokens,
                rng=trainer.update_rng, reference=None if cfg.algorithm.kl_in_reward else trainer.reference,
                watch=watch,
            )
            t.add_tokens("train", sum(len(s.tokens) for s in samples))
    if samples and trainer.critic is not None:
        with stage("critic") as t:
            metrics |= value_update(samples, trainer.critic, cfg.algorithm, pad_id=pad_id, rng=trainer.update_rng)
            t.add_tokens("critic", sum(len(s.tokens) for s in samples))
    return metrics


def log_step(run: Run, step: int, groups: list[Group], step_metrics: dict[str, Any], timer) -> dict[str, Any]:
    """Write the step's metrics (rollout, sampling, training, timing, an evaluation when due) and samples."""
    cfg, log = run.cfg, run.logger
    metrics, errors = rollout_metrics(groups, accuracy_reward=cfg.data.task)  # a task's verifier, if any
    metrics |= step_metrics | timer.report() | run.rollout.rewards.drain_metrics()  # TRL's log_metric
    metrics["throughput/e2e_tok_s"] = timer.tokens.get("generate", 0) / metrics["timing_s/step"]
    metrics |= efficiency_metrics(metrics)
    for e in errors:
        log.message(f"step {step}: {e}")
    if cfg.controller.eval_every and step % cfg.controller.eval_every == 0 and run.eval_rows is not None:
        metrics |= held_out(run)
    log.log(step, metrics)
    log.log_samples(step, sample_records(groups, cfg.tracking.log_samples, run.tokenizer))
    return metrics


def rollout(cfg: RLConfig, side: RolloutSide, step: int) -> tuple[list[Group], dict[str, float]]:
    """Sample prompts from `side.source`, then generate and score one step's groups with `side.actor` (the
    generator, the agent loop or the proxy collector; each times its own generate and reward stages). `side` is
    the trainer's (colocated) or a producer's own (`controller.placement.producer_side`).

    With `algorithm.dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped and more
    prompts are drawn to refill the step, for at most `max_sampling_rounds` rounds; the step then trains on
    what it has. DAPO's overlong shaping is added to the rewards here too.
    """
    algo = cfg.algorithm
    want = cfg.controller.prompts_per_step
    rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
    groups: list[Group] = []
    dropped = 0
    info: dict[str, float] = {}
    for _ in range(rounds):
        rows = side.source.next_rows(want - len(groups))
        new, made = side.actor.rollout(rows, version=side.engine.version, first_group=len(groups))
        info |= made
        if zero_mismatch(cfg):  # the trainer's own numbers for what the engine drew
            new = exact_logprobs(cfg, side.engine, new)
        new = shape_overlong(new, cfg.generation.max_tokens, algo.overlong_buffer, algo.overlong_penalty)
        if algo.dynamic_sampling:
            kept = [g for g in new if has_spread(g)]
            dropped += len(new) - len(kept)
            new = kept
        groups += new
        if len(groups) >= want:
            break
    if algo.dynamic_sampling:
        info["sampling/dropped_groups"] = float(dropped)
    return groups, info


def exact_logprobs(cfg: RLConfig, engine, groups: list[Group]) -> list[Group]:
    """With `training.spec.zero_mismatch(cfg)` (deterministic, an engine in this process, the local trainer):
    the groups with the logprobs of a scoring pass through the trainer's per-sample function
    (`training.logprobs.rescore_groups`; samples of the engine's current weights; with router replay r3 through
    each sample's recorded experts), timed as `timing_s/rescore`; other engines' groups as they came
    (docs/reliability.md, "Zero mismatch")."""
    from tokenmill.engines.local.hf import HFEngine
    from tokenmill.training.logprobs import rescore_groups

    tr = cfg.training
    if not isinstance(engine, HFEngine):  # a vision-language engine: its samples keep the decode pass's logprobs
        return groups
    with stage("rescore"):
        return rescore_groups(engine.model, groups, temperature=cfg.generation.temperature,
                              chunk_bytes=int(tr.logprob_chunk_mib * 2**20) if tr.chunked_logprobs else 0,
                              autocast_dtype=engine.autocast_dtype, version=engine.version,
                              replay=tr.router_replay == "r3")  # the decode pass's experts, as the trainer


def preemption(run: Run) -> Preemption:
    """The loop's signal handlers (`checkpoint.preempt`), agreeing over torchrun's ranks."""
    return Preemption(run.cfg.checkpoint.preempt_timeout_s, root=run.output_dir / "checkpoints",
                      steps=run.cfg.controller.steps, agree=max_over_ranks, say=run.logger.message)


def save(run: Run, step: int, feed: Feed) -> Path:
    """Checkpoint `step` (every rank calls it: the sharded state is a collective); return its folder."""
    trainer, side = run.trainer, run.rollout
    state = {
        "trainer": trainer.backend.state_dict(),
        "engine": side.engine.state_dict(),  # its sampling RNG
        "update_rng": trainer.update_rng.getstate(),
        "rng": rng_state(),
        "data": side.source.state_dict(),
        "rollouts": feed.state_dict(),  # async: batches generated ahead, not trained yet
    }
    if trainer.critic is not None:
        state["critic"] = trainer.critic.state_dict()
    root = run.output_dir / "checkpoints"
    if is_main():  # one writer of the folder (with fsdp2 every rank wrote its shards in state_dict above)
        save_checkpoint(root, step, trainer.model, state,
                        keep_last=run.cfg.checkpoint.keep_last, fingerprint=run_fingerprint(run.cfg, trainer.model))
    barrier()
    return root / checkpoint_name(step)


def resume(run: Run) -> tuple[int, dict]:
    """Restore weights, optimiser, schedule, RNGs and data position; return the step to continue after and
    the rollouts that were buffered (async) for the feed to serve first."""
    # a damaged checkpoint is reported even with tracking.console none (then as a logging warning)
    trainer, side = run.trainer, run.rollout
    warn = run.logger.message if run.cfg.tracking.console != "none" else None
    # what the checkpoint means (model, algorithm, data, group size) must match this run's: checked before loading
    check = resume_check(run_fingerprint(run.cfg, trainer.model), anyway=run.cfg.checkpoint.resume_anyway,
                         say=run.logger.message)
    found = load_latest(run.output_dir / "checkpoints", trainer.model, warn=warn, check=check)
    if found is None:
        run.logger.message("resume: no complete checkpoint found, starting from scratch")
        return 0, {}
    path, step, state = found
    if "engine" not in state and "engine_rng" in state:  # written before the engine kept a state dict
        state["engine"] = {"rng": state["engine_rng"]}
    missing = [k for k in ("trainer", "engine", "update_rng", "rng", "data") if k not in state]
    if trainer.critic is not None and "critic" not in state:
        missing.append("critic (a PPO run resumed from the checkpoint of a run without one)")
    if missing:
        raise ConfigError(f"checkpoint.resume: {path} lacks {', '.join(missing)}; it was written by another kind "
                          "of run or an older tokenmill: resume from a checkpoint of this run, or start afresh "
                          "(checkpoint.resume false, or another tracking.output_dir)")
    trainer.backend.load_state_dict(state["trainer"])
    side.engine.load_state_dict(state["engine"])
    version, internal, gauss = state["update_rng"]
    trainer.update_rng.setstate((version, tuple(internal), gauss))
    set_rng_state(state["rng"])
    side.source.load_state_dict(state["data"])
    if trainer.critic is not None:
        trainer.critic.load_state_dict(state["critic"])
    side.engine.update_weights(trainer.backend.weights(), version=step)
    run.logger.message(f"resumed from {path} (step {step})")
    return step, state.get("rollouts", {})
