"""Build every component of a run from a validated config (no loop logic here).

Order matters for the user: everything that can be wrong with the config or the rewards is checked before
any model is loaded.
"""

from __future__ import annotations

import gc
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from tokenmill.checkpoint.lock import RunLock, lock_run_folder
from tokenmill.checkpoint.space import check_free_space
from tokenmill.config.schema import RLConfig
from tokenmill.controller.trainer import Trainer, build_trainer, trainer_kind
from tokenmill.data.build import build_datasets
from tokenmill.data.prompts import PromptSource
from tokenmill.engines.base import InferenceEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.routing import moe_routers
from tokenmill.engines.local.vision import VisionEngine, is_vision_config
from tokenmill.rewards.build import build_rewards
from tokenmill.rewards.set import RewardSet
from tokenmill.rollout.agent import AgentLoop, build_agent
from tokenmill.rollout.base import Rollout
from tokenmill.rollout.generator import Generator, build_generator
from tokenmill.rollout.record import ReplayEngine
from tokenmill.rollout.vision import check_images_fit
from tokenmill.tracking.logger import MetricsLogger
from tokenmill.training.model import autocast_dtype, check_memory, load_policy, resolve_device
from tokenmill.training.teacher import build_teacher, check_teacher_data
from tokenmill.types import ConfigError


@dataclass
class RolloutSide:
    """What one thread rolls out with: the engine, the actor the loop's `rollout` calls (the generator, the agent
    loop, a proxy collector; sharded under fsdp2), the evaluator of held-out rows (the generator or the agent
    loop, greedy), the prompt source and the rewards. The trainer's thread has the run's; an async producer has
    its own (`controller.placement.producer_side`), and the two share nothing but the rewards."""

    engine: InferenceEngine
    actor: Rollout
    evaluator: Generator | AgentLoop
    source: PromptSource
    rewards: RewardSet


# names the Run had before it was split into its two sides: still readable, with a warning naming the new path
_MOVED = {
    "model": "trainer", "backend": "trainer", "reference": "trainer", "critic": "trainer", "teacher": "trainer",
    "update_rng": "trainer", "engine": "rollout", "actor": "rollout", "source": "rollout", "generator": "rollout",
    "agent": "rollout",
}


@dataclass
class Run:
    """A built run: its config, the trainer side, the trainer thread's rollout side, and what the loop logs
    to and writes in."""

    cfg: RLConfig
    trainer: Trainer
    rollout: RolloutSide
    tokenizer: Any
    eval_rows: Any
    logger: MetricsLogger
    output_dir: Path
    engine_fleet: Any = None  # engine.placement process on Ray: the replicas (controller.ray.engines.EngineFleet)
    monitors: tuple[Any, ...] = ()  # health checks beside cfg.health's (hooks: tokenmill.health.monitors)
    lock: RunLock | None = None  # the run folder's (checkpoint.lock); the main rank's only
    eval_before: dict[str, float] | None = None  # the held-out evaluation before training (run_rl sets it)

    def __getattr__(self, name: str) -> Any:
        side = _MOVED.get(name)
        if side is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        new = {"generator": "evaluator", "agent": "evaluator"}.get(name, name)
        warnings.warn(f"Run.{name} is Run.{side}.{new}", DeprecationWarning, stacklevel=2)
        value = getattr(getattr(self, side), new)
        if name == "agent" and not isinstance(value, AgentLoop):
            return None
        return value

    def close(self) -> None:
        gc.unfreeze()
        self.rollout.rewards.close()
        if getattr(self.rollout.evaluator, "plays_episodes", False):  # a VerifiersRollout: its server and engine
            self.rollout.evaluator.close()
        self.logger.close()
        if self.trainer.teacher is not None:
            self.trainer.teacher.close()
        if self.lock is not None:
            self.lock.release()


# where a vision-language policy's rollouts may run: beside the trainer's module, on a copy of it in a producer
# thread or a worker process, or in spawned `tokenmill serve` processes (which take pictures as `image_url` parts)
VISION_PLACEMENTS = ("colocated", "thread", "worker", "process", "remote")


def vision_engine(cfg: RLConfig, model: torch.nn.Module, tokenizer: Any, amp: torch.dtype | None,
                  sharded: bool) -> VisionEngine:
    """The engine of a vision-language policy (each prompt's images encoded once per group), after the checks
    of what does not take images yet."""
    if cfg.engine.placement not in VISION_PLACEMENTS:
        raise ConfigError(f"engine.placement: a vision-language model generates with its own module (colocated), "
                          f"a copy in a rollout thread (thread) or a worker process (worker), or spawned "
                          f"`tokenmill serve` processes (process) or servers at engine.urls (remote); "
                          f"{cfg.engine.placement} does not take images yet")
    if cfg.engine.placement == "remote" and cfg.env is not None:
        raise ConfigError("engine.placement: remote servers take images in chat messages, single-turn prompts "
                          "only; a multi-turn run with images needs colocated, thread, worker or process")
    if cfg.controller.partial_rollouts:
        raise ConfigError("controller.partial_rollouts: interrupting generations is done for text models only; "
                          "a vision-language run finishes each rollout on the weights it started with")
    if sharded:  # each prompt seeded by its place in the step, whichever rank draws it
        from tokenmill.training import dist

        return dist.RankedVisionEngine(model, tokenizer, seed=cfg.training.seed, autocast_dtype=amp)
    return VisionEngine(model, tokenizer, seed=cfg.training.seed, autocast_dtype=amp)


def build_run(cfg: RLConfig, rewards: list[Callable[..., Any]] | None = None, dataset=None, *,
              trainer_group: Any = None, role_groups: dict | None = None) -> Run:
    """Every part of a run of `cfg`. `rewards`: Python reward functions beside the config's; `dataset`: rows in
    place of `data.path`; `trainer_group`: the Ray trainer ranks of a `cluster.backend: ray` run; `role_groups`:
    where its `cluster.roles` run outside the driver (`controller.ray.roles.PlacedRoles.for_run`)."""
    if cfg.training.deterministic:  # first: MKL and cuBLAS read their reproducibility mode once
        from tokenmill.checkpoint.determinism import make_deterministic

        make_deterministic()
    torch.manual_seed(cfg.training.seed)
    random.seed(cfg.training.seed)
    train_rows, eval_rows, task_reward = build_datasets(cfg, dataset)
    check_teacher_data(cfg.distillation, train_rows)  # routing column and self-teacher template, before loading
    reward_set = build_rewards(cfg, rewards, task_reward, model_reward=(role_groups or {}).get("reward_model"))
    sharded = trainer_kind(cfg) == "fsdp2"  # this process is one torchrun rank
    if sharded:  # join the torchrun group first: with CUDA that picks this rank's GPU
        from tokenmill.training import dist

        dist.init_distributed()
    # one writer per folder, taken before the model loads (released by close, or by the kernel on any exit)
    lock = lock_run_folder(cfg.tracking.output_dir) if not sharded or dist.is_main() else None
    if lock is not None:  # room for a checkpoint and the export (checkpoint.space), also before the model loads
        check_free_space(cfg)
    device = resolve_device(cfg.model.device)
    check_memory(cfg, device)  # a run that will not fit its device is refused here, before the weights load
    amp = autocast_dtype(cfg.model, device)
    model, tokenizer = load_policy(cfg.model, device)
    if cfg.training.router_replay != "off" and not moe_routers(model):
        raise ConfigError(f"training.router_replay: {cfg.model.path} has no mixture-of-experts router to replay; "
                          "set it to off")
    check_images_fit(cfg, model, train_rows)
    # colocated, in-process: the engine samples from the trainer's own module, so weight sync is free
    # (fsdp2: each rank's engine samples from a full copy, refreshed from the shards after every update)
    if cfg.record.replay is not None:  # trains on recorded rollouts: nothing generates, nothing evaluates
        engine, eval_rows = ReplayEngine(model, tokenizer), None
    elif is_vision_config(model.config):  # a vision-language policy: images encoded once per group
        engine = vision_engine(cfg, model, tokenizer, amp, sharded)
    else:
        engine = (dist.RankedEngine if sharded else HFEngine)(
            model, tokenizer, seed=cfg.training.seed, autocast_dtype=amp,
            fast_decode=cfg.engine.fast_decode, cuda_graphs=cfg.engine.cuda_graphs,
            compile_step=cfg.engine.compile_step,
            max_batch_tokens=cfg.engine.max_batch_tokens, **cfg.engine.paged_options())
        if cfg.training.router_replay == "r3":  # the experts it picks, replayed by the trainer
            engine.record_routing(True)
    teacher = build_teacher(cfg.distillation, model, tokenizer, device, autocast_dtype=amp)
    trainer = build_trainer(cfg, model, device, amp, teacher, ray_group=trainer_group, role_groups=role_groups)
    generator = build_generator(cfg, engine, tokenizer, reward_set)
    agent = build_agent(cfg, engine, tokenizer) if cfg.env is not None else None
    out = Path(cfg.tracking.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tk = cfg.tracking
    actor: Rollout = agent or generator
    if sharded:  # each rank plays its share of the prompts; rank 0 alone logs and evaluates
        actor = dist.ShardedRollout(actor, engine if isinstance(engine, dist.PromptSeeded) else None)
    if sharded and not dist.is_main():
        logger, eval_rows = dist.QuietLogger(), None
    else:
        logger = MetricsLogger(
            out, cfg.controller.steps, console=tk.console, log_every=tk.log_every, tensorboard=tk.tensorboard,
            wandb=tk.wandb, wandb_project=tk.wandb_project, run_config=cfg.model_dump(mode="json"),
            trackio=tk.trackio, mlflow=tk.mlflow,
        )
    source = PromptSource(train_rows, seed=cfg.training.seed, shuffle=cfg.data.shuffle)
    side = RolloutSide(engine, actor, agent or generator, source, reward_set)
    run = Run(cfg, trainer, side, tokenizer, eval_rows, logger, out, lock=lock and lock.adopt())
    # the setup's objects (modules, model, datasets: hundreds of thousands) leave the garbage collector's sight
    # until `close`: a full collection in the loop would otherwise scan them all (200 ms on the quickstart)
    gc.freeze()
    return run
