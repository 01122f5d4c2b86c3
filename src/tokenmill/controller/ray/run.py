"""`tokenmill train` with `cluster.backend: ray`: the usual loop in the driver, its trainer on Ray.

The driver builds the run as always and keeps its colocated engine (generation, scoring, logging,
checkpoint folders and the export happen here); the trainer's verbs go to `cluster.trainer_ranks`
`ShardedBackend` ranks on a placement group (`RayBackend`), and after every update rank 0's full weights
come back into the driver's model, which the engine samples from. When a rank fails, the group is rebuilt on
the same placement group and the run is built again from the last checkpoint (`checkpoint.every`), at most
`cluster.max_restarts` times, each logged; with no checkpoint yet, it starts over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.controller.ray.cluster import connect
from tokenmill.controller.ray.workers import BackendSpec, RankFailure, RayBackend, WorkerGroup


def _backend_kwargs(cfg, run) -> dict[str, Any]:
    """The keyword arguments `build_run` gives its `LocalBackend`, so that the ranks train alike."""
    tr, gen = cfg.training, cfg.generation
    return {
        "learning_rate": tr.learning_rate, "weight_decay": tr.weight_decay, "betas": tr.betas,
        "total_steps": cfg.controller.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches,
        "warmup_steps": tr.warmup_steps, "lr_schedule": tr.lr_schedule, "max_grad_norm": tr.max_grad_norm,
        "micro_batch_tokens": tr.micro_batch_tokens, "temperature": gen.temperature,
        "autocast_dtype": run.engine.autocast_dtype, "share_prompts": tr.share_prompts,
    }


def train_on_ray(cfg, rewards=None, cluster=None) -> dict[str, Any]:
    """Run `cfg` with its trainer on Ray (`cluster`: an open connection, else `cluster.address` is joined or a
    local cluster started and closed at the end); the loop's result plus `restarts`. `rewards` as for
    `build_run`."""
    from tokenmill.controller import build_run, run_rl
    from tokenmill.types import ConfigError

    c = cfg.cluster
    if cfg.model.lora.rank > 0 or cfg.training.backend != "local" or cfg.engine.placement != "colocated":
        raise ConfigError("cluster.backend: ray trains full weights (no model.lora), with training.backend "
                          "local and engine.placement colocated (the driver's engine) for now")
    owned = cluster is None
    cluster = cluster or connect(c.address, num_cpus=c.nodes * c.cpus_per_node if c.address is None else None,
                      num_gpus=c.nodes * c.gpus_per_node if c.address is None else 0,
                      call_timeout_s=c.call_timeout_s, start_timeout_s=c.start_timeout_s)
    run = group = None
    try:
        run = build_run(cfg, rewards)
        shards = Path(cfg.tracking.output_dir).resolve() / "checkpoints" / "shards"
        spec = BackendSpec(cfg.model.path, str(shards), seed=cfg.training.seed,
                           backend_kwargs=_backend_kwargs(cfg, run))
        group = WorkerGroup(cluster, spec, c.trainer_ranks, cpus_per_rank=c.cpus_per_rank,
                            gpus_per_rank=c.rank_gpus, strategy=c.strategy, start_timeout_s=c.start_timeout_s)
        restarts = 0
        while True:
            run.backend = RayBackend(group)
            try:
                result = run_rl(run)
                break
            except RankFailure as exc:
                if restarts >= c.max_restarts:
                    raise RankFailure(f"{exc}; gave up after {c.max_restarts} restart(s) (cluster.max_restarts)"
                                      ) from None
                restarts += 1
                run.logger.message(f"{exc}: rebuilding the trainer group (restart {restarts} of at most "
                                   f"{c.max_restarts}), then resuming from the last checkpoint")
                group.rebuild()
                run.close()
                run = None
                cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
                run = build_run(cfg, rewards)  # fresh weights, data position and RNGs; resume() restores them
        result["restarts"] = restarts
        return result
    finally:
        if group is not None:
            group.close()
        if run is not None:
            run.close()
        if owned:
            cluster.close()
