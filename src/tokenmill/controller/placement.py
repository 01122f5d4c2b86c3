"""Where the async producer's engine lives (`engine.placement`), and how new weights reach it.

- thread:  a second `HFEngine` in this process holding a copy of the weights. The trainer's `push` stages a
           copy; the producer thread applies it between rollouts (or, with partial rollouts, between chunks of
           tokens), so the engine's weights never change under a running forward.
- process: `tokenmill serve` subprocesses on free loopback ports, reached through `RemoteEngine`; weights
           go through `tokenmill.sync` (files or broadcast). The servers are stopped at the end.
- worker:  the in-process engine in a spawned worker process (`engines.local.worker`): the two sides run at once
           on their own cores; a push copies the weights into shared memory, the producer has the worker
           load them between rollouts. CPU only.
- remote:  the same client and sync, for servers at `engine.urls` (ours, vLLM, SGLang).

Colocated runs need none of this (the engine shares the trainer's module; see `feeds.InlineFeed`).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.rollout.agent import build_agent
from tokenmill.rollout.generator import Generator, build_generator
from tokenmill.sandbox.lifetime import parent_env, preexec_die_with_parent, stop_process
from tokenmill.types import ConfigError, Group, TokenmillError


class _LockedRewards:
    """The run's reward set, one caller at a time: the producer scores rollouts while the trainer may score a
    held-out evaluation, and a forked reward worker serves one request at a time."""

    def __init__(self, rewards, lock: threading.Lock) -> None:
        self.rewards, self.lock = rewards, lock

    def score(self, *args: Any, **kwargs: Any):
        with self.lock:
            return self.rewards.score(*args, **kwargs)

    def close(self) -> None:
        self.rewards.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rewards, name)


@dataclass
class Placement:
    """The producer's engine and what drives it; `push` runs in the trainer's thread, `apply_pending` and
    `stamp_versions` in the producer's."""

    engine: Any
    generator: Generator
    agent: Any

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError

    def apply_pending(self) -> bool:
        """Load staged weights into the engine if there are any; True when it did."""
        return False

    def stamp_versions(self, groups: list[Group]) -> list[Group]:
        return groups

    def describe(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ThreadPlacement(Placement):
    """A copy of the policy in this process, updated by the producer thread from staged tensors."""

    def __init__(self, engine, generator, agent) -> None:
        super().__init__(engine, generator, agent)
        self._lock = threading.Lock()
        self._staged: tuple[dict[str, torch.Tensor], int] | None = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with torch.no_grad():
            copied = {name: t.detach().clone() for name, t in named_tensors}
        with self._lock:
            self._staged = (copied, version)

    def apply_pending(self) -> bool:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        tensors, version = staged
        self.engine.update_weights(tensors.items(), version=version)
        return True

    def stamp_versions(self, groups: list[Group]) -> list[Group]:
        stamp = getattr(self.engine, "stamp", None)  # partial rollouts: per-token versions
        return stamp(groups) if stamp is not None else groups

    def describe(self) -> str:
        return "thread (in-process engine copy)"


class WorkerPlacement(Placement):
    """`engines.local.worker.WorkerEngine`: an in-process engine in a spawned worker process; a push stages the
    weights in shared memory, the producer has the worker load them between rollouts."""

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def apply_pending(self) -> bool:
        return self.engine.apply_staged()

    def describe(self) -> str:
        return f"worker (engine process {self.engine.process.pid})"

    def close(self) -> None:
        self.engine.close()


class ServerPlacement(Placement):
    """Engines behind HTTP (`RemoteEngine`); the trainer pushes weights through `tokenmill.sync`."""

    def __init__(self, engine, generator, agent, urls: list[str], processes: list[subprocess.Popen] | None = None,
                 scratch: tempfile.TemporaryDirectory | None = None, lora_model: torch.nn.Module | None = None,
                 ours: bool = False) -> None:
        super().__init__(engine, generator, agent)
        self.urls, self.processes, self.scratch = urls, processes or [], scratch
        self.lora_model = lora_model
        self.ours = ours  # tokenmill servers (spawned here, or Ray's fleet): they stage pushes, report versions

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.lora_model is not None:  # a server holds the plain model: send W + BA under the plain names
            from tokenmill.sync import merged_lora_weights

            named_tensors = merged_lora_weights(self.lora_model)
        self.engine.update_weights(named_tensors, version=version)

    def apply_pending(self) -> bool:
        """Nothing to apply (pushes land on the servers directly); remember the version at the rollout's start
        for servers that report none (vLLM, SGLang)."""
        self._version_at_start = self.engine.version
        return False

    def stamp_versions(self, groups: list[Group]) -> list[Group]:
        """Each group carries the version its server reported (the oldest, when a weight update landed during
        the batch): the server's word, not the version last pushed. Without one, the version published when
        the rollout started (a push during it may or may not have reached the samples: assume not)."""
        seen = self.engine.versions_seen
        oldest = min(seen) if seen else getattr(self, "_version_at_start", self.engine.version)
        seen.clear()
        return [Group(g.group_id, tuple(s.with_(version=min(s.version, oldest)) for s in g.samples)) for g in groups]

    def describe(self) -> str:
        kind = "process" if self.processes else "remote"
        return f"{kind} servers {', '.join(self.urls)}"

    def close(self) -> None:
        self.engine.close()
        for p in self.processes:  # all asked at once, then each given its 10 s
            p.terminate()
        for p in self.processes:
            stop_process(p, terminate=False)
        if self.scratch is not None:
            self.scratch.cleanup()


def thread_split(cfg) -> tuple[int, int]:
    """(torch threads per engine, torch threads for the trainer) on this machine's cores. Two OpenMP pools
    that together ask for more threads than there are cores spin against each other (measured here: a
    training step 30x slower), so generation gets `engine.threads` (default: half the cores, shared by the
    spawned servers) and the trainer at most the rest (never more than it has). Remote engines take no cores
    here: (0, 0) = leave as is."""
    if cfg.engine.placement in ("colocated", "remote"):
        return 0, 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    engines = cfg.engine.num_servers if cfg.engine.placement == "process" else 1
    per_engine = cfg.engine.threads or max(1, cores // (2 * engines))
    return per_engine, max(1, min(torch.get_num_threads(), cores - per_engine * engines))


def spawn_servers(model_dir: str, count: int, *, threads: int = 0, timeout_s: float = 120.0, seed: int = 0,
                  device: str = "cpu", log_dir: Path | None = None) -> tuple[list[str], list[subprocess.Popen]]:
    """Start `count` `tokenmill serve MODEL_DIR --port 0` processes (each binds a free loopback port and names
    it in its ready line, so no port can be taken in between) and wait until each is ready."""
    from tokenmill.serving import wait_for_port

    urls, procs = [], []
    env = parent_env(dict(os.environ))  # `tokenmill serve` watches for this process
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        for i in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", "serve", model_dir, "--port", "0", "--seed",
                 str(seed + i), "--device", device], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                # a kill -9 of the trainer takes its servers along; the hook only calls prctl and getppid
                preexec_fn=preexec_die_with_parent(),  # noqa: PLW1509
            ))
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(procs):
            log = open(log_dir / f"server_{i}.log", "wb") if log_dir else None  # noqa: SIM115
            try:
                port = wait_for_port(proc, timeout_s=max(0.0, deadline - time.monotonic()), log=log)
            except (TimeoutError, ChildProcessError) as exc:
                raise TokenmillError(f"engine.placement process: `tokenmill serve` #{i} {exc} "
                                     f"(engine.timeout_s={timeout_s:g}s)") from None
            urls.append(f"http://127.0.0.1:{port}")
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return urls, procs


def _weight_sync(cfg, urls: list[str], token: str | None, scratch: Path, ours: bool = False):
    """The push to `urls`; `ours`: tokenmill servers (spawned here or by the Ray fleet), which take packed
    broadcasts."""
    from tokenmill.sync import BroadcastSync, FileSync
    from tokenmill.sync.broadcast import PACKED_BUCKET_BYTES

    # with several servers, one that stops answering is dropped (the pool sends its requests elsewhere) and
    # the run goes on; a refusal, or the last server gone, still stops it
    survive = len(urls) > 1
    if cfg.engine.weight_sync == "files":
        return FileSync(urls, scratch / "weights", token=token, timeout_s=cfg.engine.timeout_s, drop_failed=survive)
    if cfg.engine.weight_sync == "vllm":  # vLLM's own reload routes (tokenmill.engines.vllm)
        from tokenmill.engines.vllm.sync import VLLMReloadSync

        return VLLMReloadSync(urls, scratch / "weights", token=token, timeout_s=cfg.engine.timeout_s,
                              drop_failed=survive)
    if cfg.engine.weight_sync == "vllm_broadcast":  # gloo into tokenmill's vLLM worker extension
        from tokenmill.engines.vllm.sync import VLLMBroadcastSync

        return VLLMBroadcastSync(urls, token=token, timeout_s=cfg.engine.timeout_s, drop_failed=survive)
    return BroadcastSync(urls, token=token, timeout_s=cfg.engine.timeout_s, drop_failed=survive,
                         bucket_bytes=PACKED_BUCKET_BYTES if ours else 0)


def build_placement(run) -> Placement:
    """The producer's engine for `run.cfg.engine.placement` (thread, worker, process or remote)."""
    cfg = run.cfg
    place = cfg.engine.placement
    rewards = _LockedRewards(run.generator.rewards, threading.Lock())
    run.generator.rewards = rewards  # the trainer's held-out evaluation takes the same lock
    if place == "thread":
        from tokenmill.engines.local.hf import HFEngine

        engine = HFEngine(copy.deepcopy(run.model), run.tokenizer, seed=cfg.training.seed,
                          autocast_dtype=run.engine.autocast_dtype)
        # one sampling stream: what a checkpoint saves (the run's engine's) is what the producer draws from
        engine.generator = run.engine.generator
        engine.version = run.engine.version
        if cfg.controller.partial_rollouts:
            from tokenmill.engines.local.partial import PartialRolloutEngine

            placement = ThreadPlacement(None, None, None)
            engine = PartialRolloutEngine(engine, cfg.controller.partial_chunk_tokens, placement)
            placement.engine = engine
        else:
            placement = ThreadPlacement(engine, None, None)
    elif place == "worker":
        from tokenmill.engines.local.worker import WorkerEngine

        if run.engine.device.type != "cpu":
            raise ConfigError(f"engine.placement: worker runs its engine on the CPU (the model is on "
                              f"{run.engine.device}); use thread, process or remote")
        engine = WorkerEngine(run.model, run.tokenizer, seed=cfg.training.seed, threads=thread_split(cfg)[0],
                              fast_decode=cfg.engine.fast_decode, max_batch_tokens=cfg.engine.max_batch_tokens,
                              timeout_s=cfg.engine.timeout_s, version=run.engine.version)
        placement = WorkerPlacement(engine, None, None)
    elif place in ("process", "remote"):
        placement = _server_placement(run)
        engine = placement.engine
    else:
        raise ConfigError(f"engine.placement: {place!r} has no producer (colocated runs in place)")
    placement.generator = build_generator(cfg, engine, run.tokenizer, rewards)
    placement.agent = build_agent(cfg, engine, run.tokenizer) if cfg.env is not None else None
    return placement


def seeded_remote_engine(urls: list[str], seed: int, **kwargs):
    """A `RemoteEngine` for `tokenmill serve` processes: a call's prompts go out as one request per server, each
    with a seed made of `seed`, the policy version and its first prompt's index since the last weight push
    (the server gives prompt i of a request seed + i). The servers' samples do not depend on what they
    served before, so a run resumed from a checkpoint (its first push sets the version) draws what an
    uninterrupted run drew."""
    from tokenmill.engines.local.worker import call_seed
    from tokenmill.engines.remote.client import RemoteEngine

    class SeededRemoteEngine(RemoteEngine):
        def generate(self, prompts, params):
            self._start, self._drawn = self._drawn, self._drawn + len(prompts)
            return super().generate(prompts, params)

        def _body(self, prompts, params, first):
            return super()._body(prompts, params, first) | {"seed": call_seed(seed, self.version, self._start + first)}

        def update_weights(self, named_tensors, version):
            super().update_weights(named_tensors, version)
            self._drawn = 0

    engine = SeededRemoteEngine(urls, prompts_per_request=0, **kwargs)
    engine._drawn = engine._start = 0
    return engine


def _server_placement(run) -> ServerPlacement:
    from tokenmill.engines.remote.client import RemoteEngine

    cfg = run.cfg
    token = cfg.engine.token or os.environ.get("TOKENMILL_SERVE_TOKEN")
    scratch = tempfile.TemporaryDirectory(prefix="tokenmill-weights-", dir=run.output_dir)
    procs: list[subprocess.Popen] = []
    fleet = run.engine_fleet  # engine replicas on Ray (tokenmill.controller.ray.engines.EngineFleet), or None
    ours = fleet is not None or cfg.engine.placement == "process"  # tokenmill servers
    try:
        if fleet is not None:
            urls = list(fleet.urls)
        elif cfg.engine.placement == "process":
            urls, procs = spawn_servers(cfg.model.path, cfg.engine.num_servers, threads=thread_split(cfg)[0],
                                        timeout_s=cfg.engine.timeout_s, seed=cfg.training.seed,
                                        device=str(run.engine.device), log_dir=run.output_dir)
        else:
            urls = list(cfg.engine.urls)
        # a LoRA run into vLLM pushes the adapters, sampled under their own name (tokenmill.engines.vllm)
        adapters = cfg.engine.weight_sync == "vllm" and cfg.model.lora.rank > 0
        if adapters:
            from tokenmill.engines.vllm.launch import LORA_ADAPTER_NAME
            from tokenmill.engines.vllm.sync import VLLMLoRASync

            # not in the scratch folder: vLLM re-reads an adapter from its path, and the last one must outlive the run
            sync = VLLMLoRASync(urls, Path(run.output_dir) / "vllm-lora", run.model.peft_config["default"],
                                token=token, timeout_s=cfg.engine.timeout_s, drop_failed=len(urls) > 1)
        else:
            sync = _weight_sync(cfg, urls, token, Path(scratch.name), ours=ours)
        kwargs = {"pad_id": run.engine.pad_id, "token": token, "timeout_s": cfg.engine.timeout_s, "sync": sync}
        if cfg.engine.placement == "process":  # our own servers: seeded requests, so a resume is exact
            engine = seeded_remote_engine(urls, cfg.training.seed, **kwargs)
        else:  # Ray's fleet is tokenmill servers too: a call's prompts go one request per server
            engine = RemoteEngine(urls, **kwargs, **({"model": LORA_ADAPTER_NAME} if adapters else {}),
                                  prompts_per_request=0 if ours else 1)
        if fleet is not None:
            fleet.attach(engine)  # a replaced replica joins its pool and sync, with the current weights
    except BaseException:
        for p in procs:
            p.kill()
        scratch.cleanup()
        raise
    lora = run.model if cfg.model.lora.rank > 0 and not adapters else None
    return ServerPlacement(engine, None, None, urls, procs, scratch, lora_model=lora, ours=ours)
