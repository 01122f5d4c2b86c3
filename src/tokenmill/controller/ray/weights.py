"""Weight sync to Ray engine replicas by broadcast (`cluster.weight_sync: broadcast`), from trainer rank 0.

With files (the default) every update's weights travel rank 0 -> object store -> driver -> a safetensors folder
-> every replica reads it back. With broadcast, trainer rank 0 opens a torch.distributed group (gloo on CPU,
NCCL on GPU: `sync.BroadcastSync`, which never touches the ranks' own FSDP group) with every replica and with
the driver, and after an update all ranks gather the full weights (a collective, one parameter at a time) and
rank 0 broadcasts them in packed buckets of `PACKED_BUCKET_BYTES`; the replicas take them through their usual
`/update_weights_from_distributed` route, and the driver receives the same buckets into its model (which the
checkpoint folders and the export read). No weight passes through the object store or the disk.

    driver                 trainer rank 0                         replicas
    push(v) ──────────────> gather (all ranks) ─ broadcast ──────> /update_weights_from_distributed
      └─ receive into its model <──────────────┘

The group is opened on the first push and again whenever the replica set changed (a dead replica replaced by
`EngineFleet`); a replacement first loads the driver's current weights from a folder (`catch_up`), so it never
serves older weights than the others. A failed push re-opens the group with the replicas listed now and tries
once more. Every wait is bounded (`timeout_s`).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.controller.ray.workers import RankFailure
from tokenmill.sync.base import WeightSyncError
from tokenmill.sync.broadcast import PACKED_BUCKET_BYTES
from tokenmill.sync.group import open_group, parse_dtype, receive_push
from tokenmill.sync.http import Servers

log = logging.getLogger("tokenmill.controller.ray")

GROUP_NAME = "tokenmill_ray_weights"


class RankWeights:
    """The trainer's new weights where they are, on the ranks (what `RayBackend.weights()` returns in a
    broadcast run). `RankBroadcastSync.push` has rank 0 broadcast them; iterating gathers rank 0's full copy
    into this process instead (any other consumer: an in-process engine, an export)."""

    on_ranks = True  # a placement that would merge LoRA weights in this process leaves them to the sync

    def __init__(self, backend) -> None:
        self.backend = backend

    def __iter__(self):
        yield from self.backend.gathered_weights()


class RankBroadcastSync:
    """A `WeightSync` (push, close) from the ranks of `group` (a `WorkerGroup`) to the replicas at `urls`, with
    `mirror` (the driver's copy of the policy) as one more receiver. `servers.urls` is the replica list an
    `EngineFleet` rewires after a replacement."""

    def __init__(self, group, urls: list[str], mirror: torch.nn.Module, *, token: str | None = None,
                 timeout_s: float = 300.0, bucket_bytes: int = PACKED_BUCKET_BYTES, backend: str = "gloo",
                 scratch: str | None = None, lora_scaling: float | None = None) -> None:
        self.group, self.mirror, self.backend = group, mirror, backend
        self.scratch = scratch  # where a replacement's catch-up folder goes (a filesystem every node sees)
        self.lora_scaling = lora_scaling  # LoRA: the ranks push their adapters alone, the replicas merge them
        # gloo: the driver is the group's last rank; NCCL (GPU ranks and replicas): a CPU driver cannot join, so
        # its copy follows through a gather from rank 0 after the broadcast
        self.driver_joins = backend == "gloo"
        self.servers = Servers(urls, token=token, timeout_s=timeout_s)
        self.token, self.timeout_s, self.bucket_bytes = token, timeout_s, bucket_bytes
        self._opened: tuple[int, tuple[str, ...]] | None = None  # (trainer generation, replica urls) of the group
        self._end = None  # the driver's end of the group
        self._layout: list[tuple[str, list[int], torch.dtype]] = []
        self.last_seconds = 0.0  # how long the last push took, end to end

    # ------------------------------------------------------------------------------------------ the group
    def _open(self) -> None:
        """Have rank 0 open the group with the replicas (their join is its HTTP call to them) and join it here
        as the last rank, both at once; then learn the push's layout (names, shapes, dtypes) from rank 0."""
        self._close_end()
        urls = list(self.servers.urls)
        host, port = self.group.cluster.get(self.group.actors[0].weight_port.remote(), timeout_s=self.timeout_s,
                                            what="trainer rank 0: a weight-group port")
        ref = [a.open_weight_sync.remote(urls, host, port, self.token, self.timeout_s, self.bucket_bytes,
                                         self.backend, int(self.driver_joins), self.lora_scaling)
               for a in self.group.actors]
        world = len(urls) + 2
        try:
            if self.driver_joins:
                self._end = open_group(host, port, world - 1, world, GROUP_NAME, "gloo", self.timeout_s)
        finally:
            layout = self.group._gather(ref, "trainer open_weight_sync")[0]
        self._layout = [(name, shape, parse_dtype(dtype)) for name, shape, dtype in layout]
        self._opened = (self.group.generation, tuple(urls))
        log.info("weight broadcast group open: trainer rank 0 -> %d replica(s) and the driver", len(urls))

    def _current(self) -> bool:
        joined = self._end is not None or not self.driver_joins
        return self._opened == (self.group.generation, tuple(self.servers.urls)) and joined

    # ------------------------------------------------------------------------------------------ pushes
    def push(self, named_tensors, version: int) -> None:
        """Broadcast the ranks' weights (`named_tensors` must be the `RankWeights` of this group's backend: the
        tensors are taken on the ranks, not from this process) as `version`."""
        if not isinstance(named_tensors, RankWeights):
            raise WeightSyncError("RankBroadcastSync pushes the trainer ranks' weights: pass RayBackend.weights()")
        t0 = time.monotonic()
        try:
            self._push_once(version)
        except (WeightSyncError, RankFailure, RuntimeError) as exc:  # a replica died mid-push, or the group broke
            if isinstance(exc, RankFailure) and " died " in f"{exc} ":
                raise  # a trainer rank is gone: the run rebuilds the group (train_on_ray), not the sync
            self._drop_dead()
            log.warning("weight broadcast failed (%s); re-forming the group with %s", exc, self.servers.urls)
            self._opened = None
            self._push_once(version)
        self.last_seconds = time.monotonic() - t0

    def _drop_dead(self) -> None:
        """Forget the replicas that no longer answer (the pool routes around them and `EngineFleet` replaces
        them, adding the new URL back); raises when none is left."""
        dead = set()
        for url in self.servers.urls:
            try:
                self.servers.client.get(url + "/health", timeout=5.0).raise_for_status()
            except Exception:  # noqa: BLE001 - any failure: not answering
                dead.add(url)
        if dead:
            self.servers.drop(dead)

    def _push_once(self, version: int) -> None:
        if not self._current():
            self._open()
        refs = [a.push_weights.remote(version) for a in self.group.actors]
        if not self.driver_joins:
            self.group._gather(refs, "trainer push_weights")
            with torch.no_grad():
                params = dict(self.mirror.named_parameters())
                full = self.group._gather([a.weights.remote() for a in self.group.actors], "trainer weights")[0]
                for name, tensor in full.items():
                    params[name].copy_(tensor)
            return
        failure: list[BaseException] = []
        receiving = threading.Thread(target=self._receive, args=(failure,), name="tokenmill-weights", daemon=True)
        receiving.start()
        try:
            self.group._gather(refs, "trainer push_weights")
        except Exception:
            self._close_end()  # this side's receive fails on the closed group, if it still waits
            receiving.join(self.timeout_s)
            raise
        receiving.join(self.timeout_s)
        if failure or receiving.is_alive():
            self._close_end()
            raise WeightSyncError(f"weight broadcast: the driver's receive failed: {failure or 'timed out'}")

    def _receive(self, failure: list[BaseException]) -> None:
        """The driver's end of a push: every bucket, copied into the mirror's parameters."""
        try:
            params = dict(self.mirror.named_parameters())
            names = [n for n, _, _ in self._layout]
            with torch.no_grad():
                for i, tensor in receive_push(self._end, [d for *_, d in self._layout], [s for _, s, _ in self._layout],
                                              "cpu", self.bucket_bytes):
                    params[names[i]].copy_(tensor)
        except BaseException as exc:  # noqa: BLE001 - reported by push, in the caller's thread
            failure.append(exc)

    def catch_up(self, url: str, version: int) -> None:
        """A fresh replica (started from the model folder) loads the driver's current weights from a folder
        before the pool routes to it; it joins the broadcast group at the next push."""
        from tokenmill.sync.files import write_folder

        pushed = {name for name, _, _ in self._layout}
        with tempfile.TemporaryDirectory(prefix="tokenmill-catch-up-", dir=self.scratch) as scratch:
            path = write_folder(((n, p) for n, p in self.mirror.named_parameters() if n in pushed),
                                Path(scratch) / "weights")
            self.servers.post(url.rstrip("/"), "/update_weights_from_disk", {
                "model_path": str(path), "policy_version": int(version), "weight_version": str(version)})

    def _close_end(self) -> None:
        if self._end is not None:
            self._end.close()
            self._end = None

    def close(self) -> None:
        self._close_end()
        self.servers.close()


def rank_layout(backend) -> list[tuple[str, list[int], str]]:
    """(name, global shape, dtype name) of every tensor a rank's `weights()` yields, in order (no collective)."""
    from tokenmill.sync.group import dtype_name

    return [(n, list(p.shape), dtype_name(p.dtype)) for n, p in backend.model.named_parameters() if p.requires_grad]


class RankWeightSender:
    """The ranks' side, one per trainer rank actor: rank 0 holds the `BroadcastSync` to the replicas (and the
    driver, its last receiver); every rank takes part in gathering the full weights."""

    def __init__(self) -> None:
        self.sync = None

    def open(self, rank: int, backend, urls: list[str], host: str, port: int, token: str | None, timeout_s: float,
             bucket_bytes: int, transport: str = "gloo", receivers: int = 1,
             lora_scaling: float | None = None) -> list[tuple[str, list[int], str]] | None:
        from tokenmill.sync.broadcast import BroadcastSync

        if rank != 0:
            return None
        self.close()
        self.sync = BroadcastSync(urls, master_address=host, master_port=port, group_name=GROUP_NAME, token=token,
                                  timeout_s=timeout_s, bucket_bytes=bucket_bytes, backend=transport,
                                  receivers=receivers, lora_scaling=lora_scaling)
        return rank_layout(backend)

    def push(self, rank: int, backend, version: int) -> dict[str, Any]:
        t0 = time.monotonic()
        named = backend.weights()  # a collective: every rank consumes it all
        if rank != 0:
            for _ in named:
                pass
            return {}
        if self.sync is None:
            raise WeightSyncError("trainer rank 0: push_weights before open_weight_sync")
        self.sync.push(named, version)
        return {"seconds": time.monotonic() - t0}

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


def replica_sync(run, urls: list[str], token: str | None) -> RankBroadcastSync | None:
    """The weight sync of a Ray run's engine replicas when `cluster.weight_sync` is broadcast (None: files)."""
    cfg = run.cfg
    if cfg.cluster.weight_sync != "broadcast":
        return None
    backend = run.trainer.backend
    return RankBroadcastSync(backend.group, urls, run.trainer.model, token=token, timeout_s=cfg.engine.timeout_s,
                             backend="nccl" if cfg.cluster.engine_gpus and cfg.cluster.rank_gpus else "gloo",
                             scratch=str(run.output_dir), lora_scaling=lora_scaling(cfg.model.lora))


def lora_scaling(lora) -> float | None:
    """peft's scaling of a LoRA config's adapters (alpha / rank), None without LoRA."""
    return lora.alpha / lora.rank if lora.rank > 0 else None
