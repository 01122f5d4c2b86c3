"""`tokenmill train` with `cluster.backend: ray`: the usual loop in the driver, its trainer on Ray.

The driver builds the run as always and keeps its colocated engine (generation, scoring, logging,
checkpoint folders and the export happen here); the trainer's verbs go to `cluster.trainer_ranks`
`ShardedBackend` ranks on a placement group (`RayBackend`), and after every update rank 0's full weights
come back into the driver's model, which the engine samples from. When a rank fails, the group is rebuilt on
the same placement group and the run is built again from the last checkpoint (`checkpoint.every`), at most
`cluster.max_restarts` times, each logged; with no checkpoint yet, it starts over.

With `cluster.engine_replicas`, generation runs on that many `tokenmill serve` Ray actors instead (reached
through a `RemoteEngine` over their URLs, as `engine.placement: process` does with local servers): the new
weights go to them through a files sync after every update, and a dead replica is replaced (with the current
weights) while the pool routes around it; when none is left, the push and the requests wait for the
replacement (`cluster.replica_wait_s`). The driver's model then follows the trainer's weights, for the
checkpoint folders and the export.

Every restart (a trainer group rebuilt, an engine replica replaced) is a `restart` row in the run's
events.jsonl and is listed in its report (report.json); the held-out evaluation from before the first failure
is kept, so the result still has both ends of the "held-out greedy accuracy: a -> b" line.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenmill.controller.ray.cluster import connect
from tokenmill.controller.ray.workers import BackendSpec, RankFailure
from tokenmill.tracking import events


def _spec(cfg) -> BackendSpec:
    """What every trainer rank builds: the policy folder and the run's `TrainerSpec` (the same one the driver's
    `build_trainer` derives), so that the ranks train with every option of the config."""
    from tokenmill.training.model import autocast_dtype, resolve_device
    from tokenmill.training.spec import TrainerSpec

    shards = Path(cfg.tracking.output_dir).resolve() / "checkpoints" / "shards"
    trainer = TrainerSpec.from_config(cfg, autocast_dtype(cfg.model, resolve_device(cfg.model.device)))
    return BackendSpec(cfg.model.path, str(shards), seed=cfg.training.seed, trainer=trainer,
                       tokenizer_path=cfg.model.tokenizer_path,
                       lora=cfg.model.lora if cfg.model.lora.rank > 0 else None,
                       freeze_vision=cfg.model.freeze_vision)


def _check(cfg) -> None:
    """What this mode runs; a ConfigError names the field otherwise."""
    from tokenmill.types import ConfigError

    c, eng = cfg.cluster, cfg.engine
    if cfg.critic.lora.rank > 0:
        raise ConfigError("critic.lora: cluster.backend ray trains a full critic for now; set critic.lora.rank 0")
    if cfg.model.lora.rank > 0 and c.engine_replicas and c.weight_sync != "broadcast":
        raise ConfigError("model.lora: LoRA on Ray's engine replicas pushes the adapters alone, which the "
                          "replicas merge: set cluster.weight_sync: broadcast")
    if cfg.training.backend != "local":
        raise ConfigError("training.backend: with cluster.backend ray the trainer ranks already are FSDP2 ranks; "
                          "leave training.backend local")
    if c.engine_replicas == 0 and eng.placement != "colocated":
        raise ConfigError(f"engine.placement: {eng.placement!r} on Ray needs cluster.engine_replicas > 0 (the "
                          "`tokenmill serve` replicas started as Ray actors); or leave it colocated (the driver's "
                          "engine)")
    if c.engine_replicas and eng.placement not in ("colocated", "process"):
        raise ConfigError(f"engine.placement: cluster.engine_replicas starts `tokenmill serve` replicas on Ray; "
                          f"leave engine.placement colocated or process (not {eng.placement!r})")
    if c.engine_replicas and eng.sync not in (None, "files", "inprocess"):
        raise ConfigError(f"engine.sync: the Ray engine replicas take weights as cluster.weight_sync says (files "
                          f"or broadcast, from the trainer ranks); leave engine.sync unset, not {eng.sync!r}")


def _start_engines(cfg, cluster, group=None):
    """The `cluster.engine_replicas` `tokenmill serve` actors (None without any), checked every few seconds;
    with `cluster.colocate`, replica i in trainer rank i's bundle of `group`."""
    import os

    from tokenmill.controller.placement import kv_cache_args
    from tokenmill.controller.ray.engines import EngineFleet

    c = cfg.cluster
    if not c.engine_replicas:
        return None
    fleet = EngineFleet(cluster, cfg.model.path, c.engine_replicas, cpus=c.cpus_per_engine, gpus=c.engine_gpus,
                        seed=cfg.training.seed, device="cuda" if c.engine_gpus else "cpu",
                        threads=0 if c.engine_gpus else c.cpus_per_engine, start_timeout_s=c.start_timeout_s,
                        token=cfg.engine.token or os.environ.get("TOKENMILL_SERVE_TOKEN"),
                        replica_wait_s=c.replica_wait_s, colocate_with=group if c.colocate else None,
                        serve_args=kv_cache_args(cfg))
    fleet.watch(interval_s=5.0)
    return fleet


def _build(cfg, rewards, fleet, placed):
    """The driver's run; with engine replicas, generation goes to them (engine.placement process, files sync)
    and the driver's model follows the trainer's weights for the checkpoints and the export. `placed`: every
    worker group (`roles.PlacedRoles`): the trainer's, and where the reference, critic and reward models run."""
    from tokenmill.controller import build_run

    kwargs = {"trainer_group": placed.trainer, "role_groups": placed.for_run()}
    if fleet is None:
        return build_run(cfg, rewards, **kwargs)
    engine = cfg.engine.model_copy(update={"placement": "process", "sync": None, "num_servers": 1})
    run = build_run(cfg.model_copy(update={"engine": engine}), rewards, **kwargs)
    run.engine_fleet = fleet
    if cfg.cluster.colocate:  # the replicas share the ranks' devices: they let go of memory during each update
        run.trainer.backend.sharing = fleet
    return run


def _connect(c):
    """`cluster.address`, joined; or a local loopback cluster of `cluster.nodes` nodes (Ray's own
    `cluster_utils.Cluster` when there are several), so that the placement runs as `tokenmill plan` shows it."""
    from tokenmill.config.cluster import LOCAL_GPUS, shares_local_gpus
    from tokenmill.types import ConfigError

    if shares_local_gpus(c):
        raise ConfigError(LOCAL_GPUS)
    local = c.address is None
    cluster = connect(c.address, num_cpus=(c.cpus_per_node if c.nodes > 1 else c.nodes * c.cpus_per_node)
                      if local else None, num_gpus=(c.gpus_per_node if c.nodes > 1 else c.nodes * c.gpus_per_node)
                      if local else 0, nodes=c.nodes if local else 1, call_timeout_s=c.call_timeout_s,
                      start_timeout_s=c.start_timeout_s)
    try:
        cluster.check_plan(c)
    except BaseException:
        if local:
            cluster.close()
        raise
    return cluster


def train_on_ray(cfg, rewards=None, cluster=None) -> dict[str, Any]:
    """Run `cfg` with its trainer on Ray (`cluster`: an open connection, else `cluster.address` is joined or a
    local cluster started and closed at the end); the loop's result plus `restarts`. `rewards` as for
    `build_run`. With `cluster.engine_replicas`, generation runs on that many `tokenmill serve` actors; the
    reference, the critic and the reward models run where `cluster.roles` puts them (`controller.ray.roles`)."""
    from tokenmill.controller import run_rl
    from tokenmill.controller.ray.roles import reserve_all, role_specs, start_roles

    c = cfg.cluster
    _check(cfg)
    trainer_spec, own_specs, placements = role_specs(cfg, _spec(cfg))  # the plan: a layout that cannot fit raises
    owned = cluster is None
    if cluster is None:
        cluster = _connect(c)
    else:
        cluster.check_plan(c)
    run = placed = fleet = engines = None
    starting = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-engines")
    try:
        # every worker group's room first, in the plan's order; then the replicas start while the ranks do
        # (colocated ones after them, in the trainer ranks' bundles)
        pgs = reserve_all(cfg, placements, c.start_timeout_s)
        engines = None if c.colocate else starting.submit(_start_engines, cfg, cluster)
        placed = start_roles(cfg, cluster, trainer_spec, placements, own_specs, pgs)
        fleet = engines.result() if engines is not None else _start_engines(cfg, cluster, placed.trainer)
        run = _build(cfg, rewards, fleet, placed)
        restarts, first_eval = 0, None
        while True:
            try:
                result = run_rl(run)
                break
            except RankFailure as exc:
                if restarts >= c.max_restarts:
                    raise RankFailure(f"{exc}; gave up after {c.max_restarts} restart(s) (cluster.max_restarts)"
                                      ) from None
                restarts += 1
                first_eval = first_eval or run.eval_before
                run.logger.message(f"{exc}: rebuilding the worker groups (restart {restarts} of at most "
                                   f"{c.max_restarts}), then resuming from the last checkpoint")
                t0 = time.monotonic()
                placed.rebuild()
                events.emit("restart", role="trainer", restart=restarts, max_restarts=c.max_restarts,
                            reason=str(exc), seconds=round(time.monotonic() - t0, 2))
                run.close()
                run = None
                cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
                run = _build(cfg, rewards, fleet, placed)  # fresh weights, data position and RNGs; resume() restores them
        if first_eval is not None and "eval_before" not in result:  # evaluated before the first failure
            result["eval_before"] = first_eval
        result["restarts"] = restarts
        result["engine_restarts"] = fleet.restarts if fleet is not None else 0
        return result
    finally:
        if fleet is None and engines is not None and engines.exception() is None and engines.result() is not None:
            fleet = engines.result()  # started, but something else failed first
        if fleet is not None:
            fleet.stop()  # a replacement finishing from now on is not wired into the closing run's engine
        starting.shutdown()
        for part in (placed, run, fleet):
            if part is not None:
                part.close()
        if owned:
            cluster.close()
