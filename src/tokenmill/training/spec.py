"""`TrainerSpec`: every setting a policy trainer takes, derived from the config once and given to every backend.

A run's trainer is a `LocalBackend` in this process, a `ShardedBackend` on each torchrun rank, or a
`ShardedBackend` on each Ray trainer rank; the offline trainers (SFT, preference, reward model) are the first two.
All are built by `policy_backend(spec, model, ...)` from a frozen spec, so an option added to the config reaches them all or none (`tests/contracts/
test_trainer_spec_contract.py` checks every field on every backend).

    spec = TrainerSpec.from_config(cfg, autocast_dtype=None)
    backend = policy_backend(spec, model)                       # one process
    backend = policy_backend(spec, model, sharded=True, ...)    # an FSDP2 rank (torchrun or Ray)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.training.logprobs import DEFAULT_CHUNK_MIB, set_fast_forward


@dataclass(frozen=True)
class TrainerSpec:
    """The policy trainer's optimiser, schedule and forward settings, and the teacher its loss carries.

    `distill` is the run's `distillation:` section when the loss adds the full reverse KL to a teacher
    (`config.distill.full_kl`), else None: a backend given a spec with `distill` must be given that teacher."""

    # the optimiser and its schedule
    learning_rate: float
    total_steps: int  # optimiser steps over the run: schedules decay over these
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0
    # the forward pass
    micro_batch_tokens: int = 8192
    temperature: float = 1.0  # the sampler's: logits are divided by it
    autocast_dtype: torch.dtype | None = None
    share_prompts: bool = True
    logits_chunk_mib: float = DEFAULT_CHUNK_MIB  # 0: the model's full logits
    fast_forward: bool = True
    pack_sequences: bool = False  # whole sequences side by side in a row (SFT) instead of shared-prompt packing
    track_entropy: bool = True  # report each micro-batch's token entropy (RL's metric; offline runs skip it)
    router_replay: str = "off"  # off | r2 | r3: route MoE tokens as recorded (`training.router_replay`)
    # the trainer near peak, one GPU used to the last GiB (training.kernels, training.offload)
    activation_checkpointing: bool = False
    kernels: str = "none"  # none | liger
    optimizer_offload: bool = False
    # training.deterministic: every sample a row of its own, so its logprobs are the engine's `row_logprobs`
    batch_invariant: bool = False
    # on-policy distillation's full reverse KL in the loss
    distill: Any = None  # config.distill.DistillConfig or None

    @classmethod
    def from_config(cls, cfg: Any, autocast_dtype: torch.dtype | None) -> TrainerSpec:
        """The spec of an `RLConfig`: its `training` section, the optimiser steps the controller will take, the
        sampler's temperature, and the distillation section when its loss is the full KL."""
        from tokenmill.config.distill import full_kl

        tr, algo = cfg.training, cfg.algorithm
        return cls(
            learning_rate=tr.learning_rate,
            total_steps=cfg.controller.steps * algo.ppo_epochs * algo.mini_batches,
            weight_decay=tr.weight_decay, betas=tuple(tr.betas), warmup_steps=tr.warmup_steps,
            lr_schedule=tr.lr_schedule, max_grad_norm=tr.max_grad_norm, micro_batch_tokens=tr.micro_batch_tokens,
            temperature=cfg.generation.temperature, autocast_dtype=autocast_dtype, share_prompts=tr.share_prompts,
            logits_chunk_mib=tr.logprob_chunk_mib if tr.chunked_logprobs else 0, fast_forward=tr.fast_forward,
            activation_checkpointing=tr.activation_checkpointing, kernels=tr.kernels,
            optimizer_offload=tr.optimizer_offload, batch_invariant=zero_mismatch(cfg),
            distill=cfg.distillation if full_kl(cfg) else None, router_replay=tr.router_replay,
        )

    def backend_kwargs(self) -> dict[str, Any]:
        """`LocalBackend`'s keyword arguments (the teacher and its coefficient come with `policy_backend`)."""
        out = asdict(self)
        del out["fast_forward"], out["distill"]
        return out

    def reference_kwargs(self) -> dict[str, Any]:
        """The forward settings a KL reference model shares with the trainer."""
        return {"temperature": self.temperature, "token_budget": self.micro_batch_tokens,
                "share_prompts": self.share_prompts, "logits_chunk_mib": self.logits_chunk_mib}

    def apply_fast_forward(self, *modules: torch.nn.Module | None) -> None:
        """`training.fast_forward: false` turns the fused decoder forward off in these modules."""
        if not self.fast_forward:
            for module in modules:
                if module is not None:
                    set_fast_forward(module, False)


def policy_backend(spec: TrainerSpec, model: torch.nn.Module, *, teacher: Any = None, sharded: bool = False,
                   checkpoint_dir: str | Path | None = None, keep: int = 3) -> Any:
    """The train backend of `spec` over `model`: a `LocalBackend`, or with `sharded` a `ShardedBackend` (call
    inside a torch.distributed group; `model` is sharded in place, checkpoints in `checkpoint_dir`). `teacher`
    is the loss teacher (`training.teacher.loss_teacher`), required exactly when `spec.distill` is set."""
    if (teacher is None) != (spec.distill is None):
        raise ValueError("policy_backend: give the loss teacher exactly when the spec distils with the full KL")
    kwargs = spec.backend_kwargs()
    if teacher is not None:
        kwargs.update(distill_teacher=teacher, distill_coef=spec.distill.kl_coef)
    if sharded:
        from tokenmill.training.sharded import ShardedBackend

        backend = ShardedBackend(model, checkpoint_dir=checkpoint_dir, keep=keep, **kwargs)
    else:
        from tokenmill.training.local import LocalBackend

        backend = LocalBackend(model, **kwargs)
    spec.apply_fast_forward(model, backend.model)
    return backend


def zero_mismatch(cfg: Any) -> bool:
    """Whether an `RLConfig` run gets `training.deterministic`'s zero mismatch: deterministic with
    `zero_mismatch` on, the local trainer and an engine in its process (colocated or thread), the one that can
    score its samples through the trainer's function (docs/reliability.md, "Zero mismatch")."""
    tr = cfg.training
    return bool(tr.deterministic and tr.zero_mismatch and tr.backend == "local"
                and cfg.engine.placement in ("colocated", "thread"))
