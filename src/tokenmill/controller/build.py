"""Build every component of a run from a validated config (no loop logic here).

Order matters for the user: everything that can be wrong with the config or the rewards is checked before
any model is loaded.
"""

from __future__ import annotations

import copy
import gc
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from tokenmill.config.distill import full_kl
from tokenmill.config.imports import resolve
from tokenmill.config.schema import LoRAConfig, ModelConfig, RewardFunctionConfig, RLConfig
from tokenmill.data.prompts import PromptSource, load_rows, split_held_out
from tokenmill.engines.base import InferenceEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.rewards.base import FunctionReward
from tokenmill.rewards.model import ModelReward
from tokenmill.rewards.set import RewardSet
from tokenmill.rollout.agent import AgentLoop, build_agent
from tokenmill.rollout.base import Rollout
from tokenmill.rollout.generator import Generator, build_generator
from tokenmill.rollout.record import ReplayEngine
from tokenmill.tracking.logger import MetricsLogger
from tokenmill.training.allocator import keep_freed_memory
from tokenmill.training.base import TrainBackend
from tokenmill.training.critic import Critic, load_critic
from tokenmill.training.local import LocalBackend, ReferenceModel
from tokenmill.training.logprobs import set_fast_forward
from tokenmill.training.teacher import Teacher, build_teacher, loss_teacher
from tokenmill.types import ConfigError


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {spec!r} requested but CUDA is not available")
    return device


def autocast_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (fp32 master weights) on GPU by default; plain fp32 on CPU."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


def _reward_function(rc: RewardFunctionConfig, i: int) -> Callable[..., Any]:
    fn = resolve(rc.function, f"rewards.{i}.function")
    if not callable(fn):
        raise ConfigError(f"rewards.{i}.function: {rc.function!r} is not callable")
    return fn


def _reward_model_path(rc: Any, i: int) -> str:
    if not Path(rc.path).exists():
        raise ConfigError(f"rewards.{i}.path: no reward model folder at {rc.path!r}")
    return rc.path


def check_references(cfg: RLConfig) -> None:
    """What `validate` can check without loading a model: reward functions import and are callable, reward
    model folders exist. Raises ConfigError naming the field."""
    for i, rc in enumerate(cfg.rewards):
        if isinstance(rc, RewardFunctionConfig):
            _reward_function(rc, i)
        else:
            _reward_model_path(rc, i)


def build_rewards(cfg: RLConfig, extra: list[Callable[..., Any]] | None = None, task_reward=None) -> RewardSet:
    rewards: list[Any] = []
    if task_reward is not None:
        rewards.append(FunctionReward(task_reward, name=cfg.data.task, weight=cfg.data.task_reward_weight))
    for i, rc in enumerate(cfg.rewards):
        if isinstance(rc, RewardFunctionConfig):
            rewards.append(
                FunctionReward(
                    _reward_function(rc, i), name=rc.name, weight=rc.weight, timeout_s=rc.timeout_s,
                    per_sample=rc.per_sample, isolation=rc.isolation,
                )
            )
        else:
            path = _reward_model_path(rc, i)
            rewards.append(ModelReward(path, name=rc.name, weight=rc.weight, batch_size=rc.batch_size))
    for fn in extra or []:
        rewards.append(fn if hasattr(fn, "weight") else FunctionReward(fn))
    if not rewards and cfg.env is None:
        raise ConfigError("rewards: give at least one reward (or an env, whose episodes' returns are the reward)")
    try:
        return RewardSet(rewards, max_steps=cfg.controller.steps)
    except ValueError as exc:
        raise ConfigError(f"rewards: {exc}") from None


def build_datasets(cfg: RLConfig, dataset=None):
    """(train rows, eval rows or None, the task's reward function or None). Held-out rows: a task's own, or
    `data.num_eval` rows split off the dataset (a passed-in one only when num_eval is set), or `data.eval_path`."""
    from tokenmill.data.registry import task_splits

    data = cfg.data
    if dataset is None and data.task is not None:  # a row task brings its verifier; an env task's episodes are the reward
        return task_splits(data.task, data.num_train, data.held_out_rows, seed=cfg.training.seed, **data.task_kwargs)
    if dataset is None:
        dataset = _with_prompts(load_rows(data.path, data.split), data.prompt_column, "data.path")
    rows, held = split_held_out(dataset, data.num_eval or 0, seed=cfg.training.seed)
    if data.eval_path is not None:
        held = _with_prompts(load_rows(data.eval_path, data.split, "data.eval_path"), data.prompt_column,
                             "data.eval_path")
    return rows, held, None


def _with_prompts(rows, column: str, field: str):
    if column not in rows.column_names:
        at = "" if field == "data.path" else f" at {field}"
        raise ConfigError(f"data.prompt_column: column {column!r} not in the dataset{at} "
                          f"(columns: {', '.join(rows.column_names)})")
    return rows


def load_policy(cfg: ModelConfig, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.type == "cpu":  # a CPU trainer's steps reuse freed memory instead of faulting pages in again
        keep_freed_memory()
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.path)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, **kwargs).to(device)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot load {cfg.path!r}: {exc}") from None
    if cfg.lora.rank > 0:
        model = add_lora(model, cfg.lora)
    return model, tokenizer


def add_lora(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """Wrap the policy with peft LoRA adapters: only they train; the engine samples from the same module."""
    from tokenmill.training.lora import add_lora as wrap

    return wrap(model, cfg, task_type="CAUSAL_LM", field="model.lora")


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@dataclass
class Run:
    cfg: RLConfig
    model: torch.nn.Module
    tokenizer: Any
    engine: InferenceEngine  # colocated: an HFEngine on the trainer's module; a feed's view may hold another
    generator: Generator
    backend: TrainBackend
    reference: ReferenceModel | None
    critic: Critic | None
    agent: AgentLoop | None
    actor: Rollout  # what the loop's rollout calls: the agent loop for env runs, else the generator
    source: PromptSource
    eval_rows: Any
    logger: MetricsLogger
    update_rng: random.Random
    output_dir: Path
    engine_fleet: Any = None  # engine.placement process on Ray: the replicas (controller.ray.engines.EngineFleet)
    teacher: Any = None  # on-policy distillation's teacher (training.teacher.Teacher), or None

    def close(self) -> None:
        gc.unfreeze()
        self.generator.rewards.close()
        self.logger.close()
        if self.teacher is not None:
            self.teacher.close()


def build_run(cfg: RLConfig, rewards: list[Callable[..., Any]] | None = None, dataset=None) -> Run:
    if cfg.training.deterministic:  # first: MKL and cuBLAS read their reproducibility mode once
        from tokenmill.checkpoint.determinism import make_deterministic

        make_deterministic()
    torch.manual_seed(cfg.training.seed)
    random.seed(cfg.training.seed)
    train_rows, eval_rows, task_reward = build_datasets(cfg, dataset)
    reward_set = build_rewards(cfg, rewards, task_reward)
    sharded = cfg.training.backend == "fsdp2"
    if sharded:  # join the torchrun group first: with CUDA that picks this rank's GPU
        from tokenmill.training import dist

        dist.init_distributed()
    device = resolve_device(cfg.model.device)
    amp = autocast_dtype(cfg.model, device)
    model, tokenizer = load_policy(cfg.model, device)
    # colocated, in-process: the engine samples from the trainer's own module, so weight sync is free
    # (fsdp2: each rank's engine samples from a full copy, refreshed from the shards after every update)
    if cfg.record.replay is not None:  # trains on recorded rollouts: nothing generates, nothing evaluates
        engine, eval_rows = ReplayEngine(model, tokenizer), None
    else:
        engine = (dist.RankedEngine if sharded else HFEngine)(
            model, tokenizer, seed=cfg.training.seed + (dist.rank() if sharded else 0), autocast_dtype=amp,
            fast_decode=cfg.engine.fast_decode, cuda_graphs=cfg.engine.cuda_graphs,
            compile_step=cfg.engine.compile_step,
            max_batch_tokens=cfg.engine.max_batch_tokens)
    teacher = build_teacher(cfg.distillation, model, tokenizer, device, autocast_dtype=amp)
    backend, reference, critic = build_trainer(cfg, model, device, amp, teacher)
    generator = build_generator(cfg, engine, tokenizer, reward_set)
    agent = build_agent(cfg, engine, tokenizer) if cfg.env is not None else None
    out = Path(cfg.tracking.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tk = cfg.tracking
    actor: Rollout = agent or generator
    if sharded:  # each rank plays its share of the prompts; rank 0 alone logs and evaluates
        actor = dist.ShardedRollout(actor)
    if sharded and not dist.is_main():
        logger, eval_rows = dist.QuietLogger(), None
    else:
        logger = MetricsLogger(
            out, cfg.controller.steps, console=tk.console, log_every=tk.log_every, tensorboard=tk.tensorboard,
            wandb=tk.wandb, wandb_project=tk.wandb_project, run_config=cfg.model_dump(mode="json"),
            trackio=tk.trackio, mlflow=tk.mlflow,
        )
    run = Run(
        cfg=cfg, model=model, tokenizer=tokenizer, engine=engine,
        generator=generator, backend=backend, reference=reference, critic=critic, agent=agent,
        actor=actor,
        source=PromptSource(train_rows, seed=cfg.training.seed, shuffle=cfg.data.shuffle),
        eval_rows=eval_rows, logger=logger, update_rng=random.Random(cfg.training.seed + 1), output_dir=out,
        teacher=teacher,
    )
    # the setup's objects (modules, model, datasets: hundreds of thousands) leave the garbage collector's sight
    # until `close`: a full collection in the loop would otherwise scan them all (200 ms on the quickstart)
    gc.freeze()
    return run


def build_trainer(cfg: RLConfig, model, device, amp, teacher: Teacher | None = None) -> tuple[TrainBackend, Any, Any]:
    """The policy's train backend, the KL reference (None without KL) and the PPO critic (None without GAE);
    with `training.backend: fsdp2` all three are sharded over the torchrun group. With distillation's full
    loss (`config.distill.full_kl`) the backend's loss adds the reverse KL to `teacher`."""
    gen, tr = cfg.generation, cfg.training
    sharded = tr.backend == "fsdp2"
    if sharded:
        from functools import partial

        from tokenmill.training.sharded import ShardedBackend, ShardedCritic, ShardedReference
    optimizer_steps = cfg.controller.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
    train: dict[str, Any] = {
        "learning_rate": tr.learning_rate, "total_steps": optimizer_steps, "weight_decay": tr.weight_decay,
        "betas": tr.betas, "warmup_steps": tr.warmup_steps, "lr_schedule": tr.lr_schedule,
        "max_grad_norm": tr.max_grad_norm, "micro_batch_tokens": tr.micro_batch_tokens,
        "temperature": gen.temperature, "autocast_dtype": amp, "share_prompts": tr.share_prompts,
        "logits_chunk_mib": tr.logprob_chunk_mib if tr.chunked_logprobs else 0,
    }
    shards = Path(cfg.tracking.output_dir) / "checkpoints" / "shards"
    if sharded:
        backend: TrainBackend = ShardedBackend(copy.deepcopy(model), checkpoint_dir=shards,
                                               keep=cfg.checkpoint.keep_last + 1, **train)
    elif teacher is not None and full_kl(cfg):
        backend = LocalBackend(model, distill_teacher=loss_teacher(teacher, cfg.distillation),
                               distill_coef=cfg.distillation.kl_coef, **train)
    else:
        backend = LocalBackend(model, **train)
    reference = None
    if cfg.algorithm.kl_coef > 0 and sharded:  # a frozen copy sharded like the trainer; LoRA: its adapters off
        lora = cfg.model.lora.rank > 0
        reference = ShardedReference(backend.model if lora else copy.deepcopy(model), temperature=gen.temperature,
                                     token_budget=tr.micro_batch_tokens, share_prompts=tr.share_prompts,
                                     adapters_off=lora)
    elif cfg.algorithm.kl_coef > 0:
        lora = cfg.model.lora.rank > 0  # the base is the policy with its adapters off: no copy
        reference = ReferenceModel(
            model if lora else copy.deepcopy(model), temperature=gen.temperature,
            token_budget=tr.micro_batch_tokens, share_prompts=tr.share_prompts, adapters_off=lora,
            logits_chunk_mib=train["logits_chunk_mib"],
        )
    if not tr.fast_forward:
        for module in (model, getattr(backend, "model", None), getattr(reference, "model", None)):
            if module is not None:
                set_fast_forward(module, False)
    critic = None
    if cfg.algorithm.advantage == "gae":
        # fsdp2: sharded like the policy, its shards beside the policy's
        critic = (partial(ShardedCritic, checkpoint_dir=shards, keep=cfg.checkpoint.keep_last + 1)
                  if sharded else Critic)(
            load_critic(cfg.critic, cfg.model.path, device), learning_rate=cfg.critic.learning_rate,
            total_steps=optimizer_steps, value_clip=cfg.critic.value_clip, max_grad_norm=cfg.critic.max_grad_norm,
            micro_batch_tokens=tr.micro_batch_tokens, autocast_dtype=amp, share_prompts=tr.share_prompts,
        )
    return backend, reference, critic
