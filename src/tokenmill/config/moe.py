"""Cross-field checks of the mixture-of-experts options (`training.router_replay`)."""

from __future__ import annotations

from typing import Any


def check_router_replay(cfg: Any) -> None:
    """Router replay runs on the local trainer; r3 on rollouts whose engine records the routing (an `RLConfig`):
    the in-process engine (colocated, thread) or servers that answer `routed_experts` (process: spawned
    `tokenmill serve --enable-return-routed-experts`; remote: tokenmill serve or vLLM started with that flag), in
    single-turn rollouts, agent episodes (`env`, step-wise or not) and proxy mode alike."""
    mode = cfg.training.router_replay
    if mode != "off" and cfg.training.backend != "local":
        raise ValueError(f"training.router_replay: {mode} runs on training.backend local")
    if mode == "r3" and cfg.engine.placement == "worker":
        raise ValueError("training.router_replay: r3 replays the routing the engine records; the worker placement "
                         "does not record it (use colocated, thread, process or remote, or r2, which records in the "
                         "trainer)")
    if mode == "r3" and getattr(cfg, "cluster", None) is not None and cfg.cluster.engine_replicas:
        raise ValueError("training.router_replay: r3 needs engines that record the routing; Ray's engine replicas "
                         "(cluster.engine_replicas) do not (use r2, which records in the trainer)")
