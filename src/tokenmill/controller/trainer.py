"""The trainer side of a run, built in one place: the policy's backend, the KL reference and the PPO critic.

`build_trainer` picks the backend by one key, `trainer_kind(cfg)`:
- `local`: a `LocalBackend` on the policy module in this process;
- `fsdp2`: a `ShardedBackend` on this torchrun rank (reference and critic sharded alike);
- `ray`: a `RayBackend` driving `cluster.trainer_ranks` `ShardedBackend` ranks, each built from the same spec.

Every backend takes the same frozen `training.spec.TrainerSpec`, derived from the config once.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.engines.local.vision import is_vision_config
from tokenmill.training.base import TrainBackend
from tokenmill.training.critic import Critic, load_critic
from tokenmill.training.local import ReferenceModel
from tokenmill.training.spec import TrainerSpec, policy_backend
from tokenmill.training.teacher import Teacher, loss_teacher


@dataclass
class Trainer:
    """What the trainer side owns: the policy module, its backend, the frozen reference (None without KL), the
    critic (None without GAE), the distillation teacher (None without one), the RNG that shuffles mini-batches,
    and the spec the backend was built from."""

    model: torch.nn.Module
    backend: TrainBackend
    reference: ReferenceModel | None
    critic: Critic | None
    spec: TrainerSpec
    teacher: Teacher | None = None
    update_rng: random.Random = field(default_factory=random.Random)


def trainer_kind(cfg: Any) -> str:
    """`local`, `fsdp2` (training.backend) or `ray` (cluster.backend: the ranks are FSDP2 ranks on Ray)."""
    return "ray" if cfg.cluster.backend == "ray" else cfg.training.backend


def build_trainer(cfg: Any, model: torch.nn.Module, device: torch.device, amp: torch.dtype | None,
                  teacher: Teacher | None = None, *, ray_group: Any = None, role_groups: dict | None = None) -> Trainer:
    """The trainer of `cfg` over the policy `model` (on `device`, autocast `amp`). With distillation's full loss
    (`config.distill.full_kl`) the backend's loss adds the reverse KL to `teacher` (on Ray each rank loads its
    own copy from the spec); the advantages' share of distillation uses `teacher` too. `ray_group`: the
    `controller.ray.workers.WorkerGroup` of a `ray` trainer; `role_groups`: the group that computes the
    reference or the critic when `cluster.roles` places it outside the driver (`controller.ray.roles`)."""
    spec = TrainerSpec.from_config(cfg, amp)
    if spec.distill is not None and cfg.distillation.loss == "auto" and is_vision_config(model.config):
        spec = dataclasses.replace(spec, distill=None)  # images: the sampled-token estimate (training.vision_roles)
    kind = trainer_kind(cfg)
    shards = Path(cfg.tracking.output_dir) / "checkpoints" / "shards"
    keep = cfg.checkpoint.keep_last + 1
    taught = loss_teacher(teacher, spec.distill) if spec.distill is not None and kind != "ray" else None
    if kind == "ray":
        from tokenmill.controller.ray.workers import RayBackend

        if ray_group is None:
            raise ValueError("build_trainer: a ray trainer needs its WorkerGroup (controller.ray.train_on_ray)")
        replicas = cfg.cluster.engine_replicas
        backend: TrainBackend = RayBackend(ray_group, mirror=model if replicas else None,
                                           broadcast=bool(replicas) and cfg.cluster.weight_sync == "broadcast")
        if cfg.model.lora.rank > 0:  # the ranks' adapters start as this model's (its random init)
            ray_group.set_trainable({n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
    else:
        sharded = kind == "fsdp2"
        backend = policy_backend(spec, copy.deepcopy(model) if sharded else model, teacher=taught,
                                 sharded=sharded, checkpoint_dir=shards, keep=keep)
    spec.apply_fast_forward(model)
    placed = role_groups or {}
    if "reference" in placed and cfg.algorithm.kl_coef > 0:
        from tokenmill.controller.ray.roles import RayReference

        reference: ReferenceModel | None = RayReference(placed["reference"])
    else:
        reference = _reference(cfg, spec, model, backend, sharded=kind == "fsdp2")
    if "critic" in placed and cfg.algorithm.advantage == "gae":
        from tokenmill.controller.ray.roles import RayCritic

        critic: Critic | None = RayCritic(placed["critic"])
    else:
        critic = _critic(cfg, spec, device, sharded=kind == "fsdp2", shards=shards, keep=keep)
    return Trainer(model, backend, reference, critic, spec, teacher, random.Random(cfg.training.seed + 1))


def _reference(cfg, spec: TrainerSpec, model, backend, *, sharded: bool) -> ReferenceModel | None:
    """The frozen initial policy (kl_coef > 0): a copy, or for LoRA the policy with its adapters off (no copy);
    sharded like the trainer under fsdp2."""
    if cfg.algorithm.kl_coef <= 0:
        return None
    lora = cfg.model.lora.rank > 0
    if sharded:
        from tokenmill.training.sharded import ShardedReference

        frozen = backend.model if lora else copy.deepcopy(model)
        reference: ReferenceModel = ShardedReference(frozen, adapters_off=lora, **spec.reference_kwargs())
    else:
        reference = ReferenceModel(model if lora else copy.deepcopy(model), adapters_off=lora,
                                   **spec.reference_kwargs())
    spec.apply_fast_forward(reference.model)
    return reference


def _critic(cfg, spec: TrainerSpec, device, *, sharded: bool, shards: Path, keep: int) -> Critic | None:
    """PPO's value model (advantage gae): its own learning rate, the policy's schedule length and forward."""
    if cfg.algorithm.advantage != "gae":
        return None
    kwargs = critic_kwargs(cfg, spec)
    model = load_critic(cfg.critic, cfg.model.path, device, freeze_vision=cfg.model.freeze_vision)
    if sharded:
        from tokenmill.training.sharded import ShardedCritic

        return ShardedCritic(model, checkpoint_dir=shards, keep=keep, **kwargs)
    return Critic(model, **kwargs)


def critic_kwargs(cfg, spec: TrainerSpec) -> dict[str, Any]:
    """The `Critic` settings of `cfg`: its own learning rate, the policy's schedule length and forward."""
    c = cfg.critic
    return {"learning_rate": c.learning_rate, "total_steps": spec.total_steps, "value_clip": c.value_clip,
            "max_grad_norm": c.max_grad_norm, "micro_batch_tokens": spec.micro_batch_tokens,
            "autocast_dtype": spec.autocast_dtype, "share_prompts": spec.share_prompts}
