"""Engine servers (`tokenmill serve`) as Ray actors, reached through the usual `RemoteEngine`, replaced when
one dies.

Each replica is one actor that starts one `tokenmill serve` process on its node and reports the URL. The
server binds the node's address: 127.0.0.1 on a local cluster; on a multi-node cluster the node's address,
which `tokenmill serve` only accepts with a bearer token (`engine.token` or $TOKENMILL_SERVE_TOKEN). The
server dies with its actor (parent-death signal), so killing either ends the replica.

`EngineFleet.check()` (or the `watch` thread) asks every replica whether its server still runs, with a limit;
a dead one is replaced by a new actor, and the pool (`EndpointPool.replace`) and a files weight sync get the
new URL. Meanwhile the pool sends requests to the live replicas (its own failover). The new replica starts
from `model_dir` and, with a files sync, loads the weights last pushed before the pool routes to it;
`on_replace(url)` is called after that. Each replacement is a `restart` row in the run's events.jsonl.

When no replica is left (the only one died), `attach` makes the engine wait for a replacement rather than fail:
a weight push that finds every replica gone (`ReplicaSync`) replaces them at once and pushes again, and
generation retries until one answers, both for at most `replica_wait_s` seconds. A replacement that finishes
after `stop()` (the run is closing) is stopped, not wired into a closed engine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.controller.ray.cluster import LOOPBACK, ClusterError, RayCluster, import_ray
from tokenmill.sync.base import WeightSyncError
from tokenmill.sync.http import Refused
from tokenmill.tracking import events

log = logging.getLogger("tokenmill.controller.ray")


class EngineServerActor:
    """The body of one replica actor (wrapped with `ray.remote` by `EngineFleet`)."""

    def __init__(self, model_dir: str, *, seed: int, device: str, threads: int, timeout_s: float,
                 token: str | None, visible_devices: str | None = None, serve_args: tuple[str, ...] = ()) -> None:
        import ray

        from tokenmill.sandbox.lifetime import preexec_die_with_parent
        from tokenmill.serving import wait_for_port

        host = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model_dir, "--port", "0", "--host", host,
               "--seed", str(seed), "--device", device, *serve_args]
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if visible_devices is not None:  # colocated: the devices of the trainer rank it shares a bundle with
            env["CUDA_VISIBLE_DEVICES"] = visible_devices
        if host != LOOPBACK:
            if not token:
                raise ClusterError(f"engine replica on node {host}: a server reachable from other nodes needs a "
                                   "bearer token (engine.token or $TOKENMILL_SERVE_TOKEN)")
            cmd.append("--allow-remote")
        if token:
            env["TOKENMILL_SERVE_TOKEN"] = token  # in the environment, not on a command line others can read
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=preexec_die_with_parent())  # noqa: PLW1509
        try:
            port = wait_for_port(self.proc, timeout_s=timeout_s)
        except (TimeoutError, ChildProcessError) as exc:
            self.proc.kill()
            raise ClusterError(f"engine replica: `tokenmill serve` {exc}") from None
        self.url = f"http://{host}:{port}"
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "server_pid": self.proc.pid, "actor_pid": os.getpid(), "node_id": self.node_id}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        from tokenmill.sandbox.lifetime import stop_process

        stop_process(self.proc)


@dataclass
class Replica:
    actor: Any
    url: str
    server_pid: int
    actor_pid: int
    node_id: str


class EngineFleet:
    """`replicas` engine server actors of `cpus`/`gpus` each; `urls` for a `RemoteEngine`."""

    def __init__(self, cluster: RayCluster, model_dir: str, replicas: int, *, cpus: float = 1, gpus: float = 0,
                 seed: int = 0, device: str = "cpu", threads: int = 0, start_timeout_s: float = 180.0,
                 token: str | None = None, check_timeout_s: float = 10.0, replica_wait_s: float = 0.0,
                 colocate_with=None, serve_args: tuple[str, ...] = ()) -> None:
        self.cluster, self.model_dir = cluster, model_dir
        self.serve_args = serve_args  # more `tokenmill serve` flags for every replica (the key/value cache's)
        self.replica_wait_s = replica_wait_s  # how long `attach`'s engine waits for a replacement (0: not at all)
        self.colocate_with = colocate_with  # a WorkerGroup: replica i shares rank i's bundle (cluster.colocate)
        self.memory_turns = 0  # release/restore rounds asked of the replicas (colocated)
        self.cpus, self.gpus, self.seed, self.device, self.threads = cpus, gpus, seed, device, threads
        self.start_timeout_s, self.token, self.check_timeout_s = start_timeout_s, token, check_timeout_s
        self.engine = None  # a RemoteEngine whose pool (and sync) follow replacements: `attach`
        self.on_replace: Callable[[str], None] | None = None
        self.restarts = 0
        self._started = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.replicas: list[Replica] = self._start(replicas)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def _start(self, count: int, first: int = 0, timeout_s: float | None = None) -> list[Replica]:
        """`count` new replicas: numbers first, first + 1, ... (a colocated one goes to its rank's bundle),
        each given at most `timeout_s` (default: the fleet's start timeout) to start."""
        ray = import_ray()
        limit = self.start_timeout_s if timeout_s is None else min(timeout_s, self.start_timeout_s)
        actors = []
        for i in range(first, first + count):
            cls, visible = self._actor_class(ray, i)
            actors.append(cls.remote(self.model_dir, seed=self.seed + self._started, device=self.device,
                                     threads=self.threads, timeout_s=limit, token=self.token,
                                     visible_devices=visible, serve_args=self.serve_args))
            self._started += 1
        try:
            infos = self.cluster.get([a.info.remote() for a in actors],
                                     timeout_s=limit + (30 if timeout_s is None else 0),
                                     what=f"starting {count} engine replica(s)")
        except BaseException:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise
        return [Replica(a, **i) for a, i in zip(actors, infos)]

    def _actor_class(self, ray, i: int):
        """The actor options of replica `i` and the devices its server sees (None: Ray's choice). Colocated, it
        takes nothing of its own: it runs in trainer rank i's bundle and uses that rank's GPUs."""
        cls = ray.remote(EngineServerActor)
        group = self.colocate_with
        if group is None:
            return cls.options(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0), None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        visible = None
        if self.gpus:
            ids = self.cluster.get(group.actors[i].gpu_ids.remote(), timeout_s=self.check_timeout_s,
                                   what=f"trainer rank {i}: its GPUs")
            visible = ",".join(str(g) for g in ids)
        strategy = PlacementGroupSchedulingStrategy(placement_group=group.pg, placement_group_bundle_index=i)
        return cls.options(num_cpus=0, num_gpus=0, max_restarts=0, scheduling_strategy=strategy), visible

    def memory_turn(self, release: bool) -> list[dict[str, Any]]:
        """Ask every replica to let go of its device memory (`release`) or take it back: colocated replicas,
        around each update of the trainer ranks that share their devices; the answers."""
        import httpx

        route = "/release_memory_occupation" if release else "/resume_memory_occupation"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        answers = []
        for url in self.urls:
            try:
                answers.append(httpx.post(url + route, headers=headers, timeout=self.check_timeout_s).json())
            except (httpx.HTTPError, ValueError) as exc:  # a dead replica has nothing to release; check() replaces it
                answers.append({"success": False, "message": f"{type(exc).__name__}: {exc}"})
        self.memory_turns += int(release)
        return answers

    def attach(self, engine, replica_wait_s: float | None = None) -> None:
        """Follow replacements in `engine` (a `RemoteEngine` over `self.urls`): its pool and files sync. With
        `replica_wait_s` > 0 (default: the fleet's), a push or a request that finds no replica alive waits that
        long for a replacement (`ReplicaSync`; the pool's retries) instead of failing."""
        self.engine = engine
        if replica_wait_s is None:
            replica_wait_s = self.replica_wait_s
        if replica_wait_s <= 0:
            return
        if engine.sync is not None and not isinstance(engine.sync, ReplicaSync):
            engine.sync = ReplicaSync(engine.sync, self, replica_wait_s)
        pool, rounds = engine.pool, 0
        while pool.backoff_s * (2 ** rounds - 1) < replica_wait_s + self.check_timeout_s:
            rounds += 1  # all replicas down: the pool waits backoff, 2 x backoff, ... and probes between rounds
        pool.retries = max(pool.retries, rounds)

    def _is_alive(self, replica: Replica) -> bool:
        ray = import_ray()
        try:
            return bool(ray.get(replica.actor.alive.remote(), timeout=self.check_timeout_s))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def check(self, timeout_s: float | None = None) -> list[str]:
        """Replace every replica whose server or actor is gone; the new URLs (logged, and a `restart` row in
        events.jsonl). `timeout_s` bounds the whole call (a replacement the watcher has under way included)."""
        if not self._lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            return []
        try:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            new_urls = []
            for i, replica in enumerate(list(self.replicas)):
                if self._stop.is_set() or self._is_alive(replica):
                    continue
                ray = import_ray()
                ray.kill(replica.actor, no_restart=True)
                t0 = time.monotonic()
                [fresh] = self._start(1, first=i, timeout_s=None if deadline is None else max(1.0, deadline - t0))
                if self._stop.is_set():  # the run closed meanwhile: nothing to wire it into
                    ray.kill(fresh.actor, no_restart=True)
                    log.info("engine replica %s started as the run closed; stopped", fresh.url)
                    break
                self.replicas[i] = fresh
                self.restarts += 1
                seconds = round(time.monotonic() - t0, 2)
                log.warning("engine replica %s died; replaced by %s in %.1f s (restart %d)", replica.url, fresh.url,
                            seconds, self.restarts)
                self._rewire(replica.url, fresh.url)
                events.emit("restart", role="engine replica", restart=self.restarts, replica=i, old=replica.url,
                            new=fresh.url, seconds=seconds)
                new_urls.append(fresh.url)
            return new_urls
        finally:
            self._lock.release()

    def dead(self) -> list[str]:
        """The URLs of the replicas whose server or actor is gone (asked now, each with a limit)."""
        return [r.url for r in list(self.replicas) if not self._is_alive(r)]

    def _catch_up(self, url: str) -> None:
        """Load the weights last pushed by a files sync into the replica at `url` before the pool routes to it
        (a fresh replica starts from the model folder; a push it missed would leave it on version 0)."""
        engine = self.engine
        sync = getattr(engine, "sync", None)
        if hasattr(sync, "catch_up"):  # a broadcast sync: the driver's copy of the current weights
            if engine.version:
                sync.catch_up(url, int(engine.version))
            return
        last = getattr(sync, "last", None)
        if last is None or not engine.version:
            return
        sync.servers.post(url.rstrip("/"), "/update_weights_from_disk", {
            "model_path": str(last), "policy_version": int(engine.version), "weight_version": str(engine.version)})
        log.info("engine replica %s loaded the current weights (version %d)", url, engine.version)

    def _rewire(self, old: str, new: str) -> None:
        if self.engine is not None:
            try:
                self._catch_up(new)
            except RuntimeError:  # httpx: the client is closed; the run closed its engine meanwhile
                if not self._stop.is_set():
                    raise
                log.info("engine replica %s: the run closed before it loaded the current weights", new)
                return
            self.engine.pool.replace(old, new)
            servers = getattr(self.engine.sync, "servers", None)  # files sync: a list of URLs to load from
            if servers is not None:
                servers.urls = [u for u in servers.urls if u != old] + [new]
        if self.on_replace is not None:
            self.on_replace(new)

    def watch(self, interval_s: float = 2.0) -> None:
        """Check every `interval_s` seconds in a background thread until `close`."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check()
                except Exception as exc:  # a failed replacement is retried at the next check
                    if self._stop.is_set():  # closing: the engine or the actors went first
                        log.info("engine replica check stopped as the run closed: %s", exc)
                    else:
                        log.exception("engine replica check failed")

        self._watcher = threading.Thread(target=loop, name="tokenmill-engine-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """No more replacements (the run is closing); a replacement under way is stopped when it is up."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.check_timeout_s + self.start_timeout_s)
        ray = import_ray()
        stops = [r.actor.stop.remote() for r in self.replicas]
        try:
            ray.get(stops, timeout=15)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a dead replica: nothing to stop
            log.info("engine replicas: stop: %s", exc)
        for r in self.replicas:
            ray.kill(r.actor, no_restart=True)


class ReplicaSync:
    """A files weight sync to a fleet's replicas that outlives losing all of them: a push that no replica took
    (every one unreachable) has the fleet replace the dead ones now, then has the replacements load the pushed
    folder; it gives up, with the first error, after `wait_s` seconds (`cluster.replica_wait_s`). A replica
    that refuses the weights still raises at once. Everything else is the wrapped sync's (`servers`, `last`)."""

    def __init__(self, inner, fleet: EngineFleet, wait_s: float) -> None:
        self.inner, self.fleet, self.wait_s = inner, fleet, wait_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def push(self, named_tensors, version: int) -> None:
        try:
            self.inner.push(named_tensors, version)
        except Refused:
            raise
        except WeightSyncError as exc:
            if getattr(exc, "refused", False) or getattr(self.inner, "last", None) is None:
                raise
            self._again(exc, version)

    def _again(self, error: WeightSyncError, version: int) -> None:
        """Wait for live replicas, then have them all load the folder `push` wrote."""
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        log.warning("weight push %d reached no engine replica (%s); waiting up to %g s for a replacement "
                    "(cluster.replica_wait_s)", version, error, self.wait_s)
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.fleet.check(timeout_s=left)
            except ClusterError as exc:  # a replacement that did not start: try again while time is left
                log.warning("engine replica replacement failed: %s", exc)
            servers = self.inner.servers
            if servers.urls and not self.fleet.dead():
                try:
                    servers.post_all("/update_weights_from_disk", {
                        "model_path": str(self.inner.last), "policy_version": int(version),
                        "weight_version": str(version)})
                except WeightSyncError as exc:
                    if getattr(exc, "refused", False):
                        raise
                    error = exc
                else:
                    log.warning("weight push %d reached the replacement replica(s) after %.1f s", version,
                                time.monotonic() - t0)
                    return
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise WeightSyncError(f"{error}; no engine replica took the weights within {self.wait_s:g} s "
                              "(cluster.replica_wait_s)") from None
