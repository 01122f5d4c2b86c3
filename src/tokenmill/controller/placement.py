"""Where the async producer's engine lives (`engine.placement`), and how new weights reach it.

- thread:  a second in-process engine (`HFEngine`, or `VisionEngine` for a vision-language policy) holding a
           copy of the weights. The trainer's `push` stages a copy; the producer thread applies it between
           rollouts (or, with partial rollouts, between chunks of tokens), so the engine's weights never change
           under a running forward.
- process: `tokenmill serve` subprocesses on free loopback ports (`engines.server.app.spawn_servers`), reached
           through a seeded `RemoteEngine`; weights go through `engines.remote.sync.for_servers` (files or
           broadcast). The servers are stopped at the end.
- worker:  the in-process engine in a spawned worker process (`engines.local.worker`; a `VisionEngine` for a
           vision-language policy): the two sides run at once on their own cores; a push copies the weights
           into shared memory, the producer has the worker load them between rollouts. CPU only.
- remote:  the same client and sync, for servers at `engine.urls` (ours, vLLM, SGLang).

Colocated runs need none of this (the engine shares the trainer's module; see `feeds.InlineFeed`). A new
placement is a `Placement` subclass here and one branch in `build_placement`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.controller.build import RolloutSide
from tokenmill.rollout.agent import build_agent
from tokenmill.rollout.generator import build_generator
from tokenmill.sandbox.lifetime import stop_process
from tokenmill.types import ConfigError, Group


@dataclass
class Placement:
    """The producer's engine and what drives it; `push` runs in the trainer's thread, `apply_pending` and
    `stamp_versions` in the producer's. What rolls out on the engine is `producer_side(run, engine)`."""

    engine: Any

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError

    def apply_pending(self) -> bool:
        """Load staged weights into the engine if there are any; True when it did."""
        return False

    def stamp_versions(self, groups: list[Group]) -> list[Group]:
        return groups

    def stream(self) -> contextlib.AbstractContextManager:
        """What the producer thread generates under: a CUDA stream of its own where the engine shares the
        trainer's GPU (thread placement), else nothing."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ThreadPlacement(Placement):
    """A copy of the policy in this process, updated by the producer thread from staged tensors. With
    `partial_chunk` > 0 the engine is wrapped in a `PartialRolloutEngine`, which has this placement apply
    staged weights between chunks of that many tokens.

    On a GPU the producer generates on a CUDA stream of its own, so the next batch's decode kernels run
    beside the trainer's update instead of queueing behind it on the default stream. Staged weights carry an
    event recorded on the trainer's stream; the producer's stream waits for it before it reads them."""

    def __init__(self, engine, partial_chunk: int = 0) -> None:
        self._lock = threading.Lock()
        self._staged: tuple[dict[str, torch.Tensor], int, Any] | None = None
        cuda = engine.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=engine.device) if cuda else None
        if partial_chunk:
            from tokenmill.engines.local.partial import PartialRolloutEngine

            engine = PartialRolloutEngine(engine, partial_chunk, self)
        super().__init__(engine)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with torch.no_grad():
            copied = {name: t.detach().clone() for name, t in named_tensors}
        ready = None
        if self._stream is not None:  # the copies are queued on the trainer's stream: mark where they end
            ready = torch.cuda.Event()
            ready.record()
        with self._lock:
            self._staged = (copied, version, ready)

    def apply_pending(self) -> bool:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        tensors, version, ready = staged
        if ready is not None:
            current = torch.cuda.current_stream()
            current.wait_event(ready)
            for t in tensors.values():  # made on the trainer's stream, read on this one: not reused before
                t.record_stream(current)
        self.engine.update_weights(tensors.items(), version=version)
        return True

    def stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

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

    def __init__(self, engine, urls: list[str], processes: list[subprocess.Popen] | None = None,
                 scratch: tempfile.TemporaryDirectory | None = None, lora_model: torch.nn.Module | None = None,
                 ours: bool = False) -> None:
        super().__init__(engine)
        self.urls, self.processes, self.scratch = urls, processes or [], scratch
        self.lora_model = lora_model
        self.ours = ours  # tokenmill servers (spawned here, or Ray's fleet): they stage pushes, report versions

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # a server holds the plain model: send W + BA under the plain names (unless the trainer ranks push the
        # adapters themselves: Ray's broadcast, which the replicas merge)
        if self.lora_model is not None and not getattr(named_tensors, "on_ranks", False):
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
    here: (0, 0) = leave as is. A thread engine under `training.deterministic`: its fixed count on both sides (a
    reduction's order, so its rounding, is then the same in the engine's scoring pass and the trainer's)."""
    if cfg.engine.placement in ("colocated", "remote"):
        return 0, 0
    if cfg.training.deterministic and cfg.engine.placement == "thread":  # one count for the engine and the trainer
        from tokenmill.checkpoint.determinism import deterministic_threads

        return deterministic_threads(), deterministic_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    engines = cfg.engine.num_servers if cfg.engine.placement == "process" else 1
    per_engine = cfg.engine.threads or max(1, cores // (2 * engines))
    return per_engine, max(1, min(torch.get_num_threads(), cores - per_engine * engines))


def build_placement(run) -> Placement:
    """The producer's engine for `run.cfg.engine.placement` (thread, worker, process or remote)."""
    cfg, model, engine = run.cfg, run.trainer.model, run.rollout.engine
    place = cfg.engine.placement
    if place == "thread":
        copied = _engine_copy(run, engine)
        # one sampling stream: what a checkpoint saves (the run's engine's) is what the producer draws from
        copied.generator = engine.generator
        copied.version = engine.version
        if cfg.training.router_replay == "r3":
            copied.record_routing(True)
        chunk = cfg.controller.partial_chunk_tokens if cfg.controller.partial_rollouts else 0
        return ThreadPlacement(copied, partial_chunk=chunk)
    if place == "worker":
        from tokenmill.engines.local.worker import WorkerEngine

        if engine.device.type != "cpu":
            raise ConfigError(f"engine.placement: worker runs its engine on the CPU (the model is on "
                              f"{engine.device}); use thread, process or remote")
        return WorkerPlacement(WorkerEngine(
            model, run.tokenizer, seed=cfg.training.seed, threads=thread_split(cfg)[0],
            fast_decode=cfg.engine.fast_decode, max_batch_tokens=cfg.engine.max_batch_tokens,
            timeout_s=cfg.engine.timeout_s, version=engine.version, engine_options=cfg.engine.paged_options(),
            vision=getattr(engine, "takes_images", False)))
    if place in ("process", "remote"):
        return _server_placement(run)
    raise ConfigError(f"engine.placement: {place!r} has no producer (colocated runs in place)")


def _engine_copy(run, engine):
    """The thread placement's engine: the run's engine kind over a copy of the trainer's module (a
    vision-language policy's `VisionEngine`, so the producer's rows keep their pictures; else an `HFEngine`)."""
    cfg, model = run.cfg, copy.deepcopy(run.trainer.model)
    if getattr(engine, "takes_images", False):
        from tokenmill.engines.local.vision import VisionEngine

        return VisionEngine(model, run.tokenizer, seed=cfg.training.seed, autocast_dtype=engine.autocast_dtype)
    from tokenmill.engines.local.hf import HFEngine

    return HFEngine(model, run.tokenizer, seed=cfg.training.seed, autocast_dtype=engine.autocast_dtype,
                    **cfg.engine.paged_options())


def producer_side(run, engine) -> RolloutSide:
    """The producer's own rollout side over its placed `engine`: a generator (or agent loop) of its own, a copy of
    the trainer's prompt position (the feed sets the trainer's from it as batches are taken), and the run's
    rewards, which score one caller at a time (`RewardSet`), so the trainer's held-out evaluation can share them."""
    cfg, rewards = run.cfg, run.rollout.rewards
    generator = build_generator(cfg, engine, run.tokenizer, rewards)
    player = build_agent(cfg, engine, run.tokenizer) if cfg.env is not None else generator
    return RolloutSide(engine, player, player, copy.copy(run.rollout.source), rewards)


def kv_cache_args(cfg) -> tuple[str, ...]:
    """The `tokenmill serve` flags of the run's key/value cache (`engine.kv_cache`, `engine.kv_block_size`), for
    the servers a run starts itself (spawned processes, Ray's engine replicas)."""
    return ("--kv-cache", cfg.engine.kv_cache, "--kv-block-size", str(cfg.engine.kv_block_size))


def _image_args(cfg, engine) -> tuple[str, ...]:
    """A vision-language run's servers take the pictures its rows may hold (`data.max_image_pixels`)."""
    if not getattr(engine, "takes_images", False):
        return ()
    return ("--max-image-pixels", str(cfg.data.max_image_pixels))


def _server_placement(run) -> ServerPlacement:
    from tokenmill.engines.remote import sync as server_sync
    from tokenmill.engines.remote.client import RemoteEngine
    from tokenmill.engines.server.app import spawn_servers

    cfg = run.cfg
    token = cfg.engine.token or os.environ.get("TOKENMILL_SERVE_TOKEN")
    scratch = tempfile.TemporaryDirectory(prefix="tokenmill-weights-", dir=run.output_dir)
    procs: list[subprocess.Popen] = []
    fleet = run.engine_fleet  # engine replicas on Ray (tokenmill.controller.ray.engines.EngineFleet), or None
    ours = fleet is not None or cfg.engine.placement == "process"  # tokenmill servers
    r3 = cfg.training.router_replay == "r3"  # the servers record the routing; vLLM's answer it unasked
    vllm = cfg.engine.weight_sync in ("vllm", "vllm_broadcast")
    try:
        if fleet is not None:
            urls = list(fleet.urls)
        elif cfg.engine.placement == "process":
            urls, procs = spawn_servers(cfg.model.path, cfg.engine.num_servers, threads=thread_split(cfg)[0],
                                        timeout_s=cfg.engine.timeout_s, seed=cfg.training.seed,
                                        device=str(run.rollout.engine.device), log_dir=run.output_dir,
                                        extra_args=(*kv_cache_args(cfg), *_image_args(cfg, run.rollout.engine),
                                                    *(("--enable-return-routed-experts",) if r3 else ())))
        else:
            urls = list(cfg.engine.urls)
        # a LoRA run into vLLM pushes the adapters, sampled under their own name (tokenmill.engines.vllm); not
        # in the scratch folder: vLLM re-reads an adapter from its path, and the last one must outlive the run
        adapters = cfg.engine.weight_sync == "vllm" and cfg.model.lora.rank > 0
        folder = Path(run.output_dir) / "vllm-lora" if adapters else Path(scratch.name) / "weights"
        sync = None
        if fleet is not None:  # Ray's replicas: cluster.weight_sync broadcast goes from the trainer ranks
            from tokenmill.controller.ray.weights import replica_sync

            sync = replica_sync(run, urls, token)
        if sync is None:
            sync = server_sync.for_servers(cfg.engine.weight_sync, urls, folder, token=token,
                                           timeout_s=cfg.engine.timeout_s, packed=ours,
                                           peft_config=run.trainer.model.peft_config["default"] if adapters else None)
        kwargs = {"pad_id": run.rollout.engine.pad_id, "token": token, "timeout_s": cfg.engine.timeout_s, "sync": sync}
        if adapters:
            from tokenmill.engines.vllm import LORA_ADAPTER_NAME

            kwargs["model"] = LORA_ADAPTER_NAME
        # our own servers (spawned here, or Ray's fleet) take a call's prompts as one request per server; the
        # spawned ones seeded per request, so a resume is exact
        engine = RemoteEngine(urls, **kwargs, prompts_per_request=0 if ours else 1,
                              seed=cfg.training.seed if cfg.engine.placement == "process" else None,
                              images=getattr(run.rollout.engine, "takes_images", False),
                              routed_experts="off" if not r3 else "server" if vllm else "ask",
                              image_route="completions" if ours else "chat")  # others take images in chat only
        if fleet is not None:
            fleet.attach(engine)  # a replaced replica joins its pool and sync, with the current weights
    except BaseException:
        for p in procs:
            p.kill()
        scratch.cleanup()
        raise
    lora = run.trainer.model if cfg.model.lora.rank > 0 and not adapters else None
    return ServerPlacement(engine, urls, procs, scratch, lora_model=lora, ours=ours)
