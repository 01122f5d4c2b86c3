"""An engine in a worker process on this machine: `HFEngine` on its own cores, new weights through shared memory.

On a CPU, generation and training running as two threads of one process cannot overlap: both hold Python's
lock for most of their many small operations. `WorkerEngine` runs the in-process engine in a worker process
(`python -m tokenmill.engines.local.worker`, started like any subprocess: nothing of the caller's `__main__` is
re-imported) with a copy of the policy, so the two sides run at once on their own cores.

- `generate` sends the prompt token ids over a socket and waits for the completions (the same `Completion`
  objects the in-process engine returns; tokens and logprobs are those of `HFEngine` on the same weights).
  A vision-language policy's worker runs a `VisionEngine` (`vision=True`): each prompt's `ImageInputs` go
  with its ids (the pixel values and grids, not the source pictures).
- `update_weights` copies the new tensors into a shared-memory staging area and returns: a memory copy, no
  serialisation, no waiting for the worker. `apply_staged` (called between rollouts) has the worker load
  the staged tensors into its own copy, so weights never change under a running forward; the two take one
  lock, so a push never lands while the worker reads.
- Sampling is seeded per call from (seed, the weights' version, the call's index since that version): a
  resumed run draws what an uninterrupted one drew, and `state_dict` is empty.
- A worker that dies (killed, out of memory) fails the next call with `EngineUnavailable` naming its exit
  code; a call that takes longer than `timeout_s` fails likewise. The worker exits when its socket
  closes, and is killed with the trainer, so it does not outlive it.

    >>> engine = WorkerEngine(model, tokenizer, threads=1)                     # doctest: +SKIP
    >>> engine.update_weights(model.named_parameters(), version=1)           # doctest: +SKIP
    >>> engine.apply_staged(); [[c]] = engine.generate([[5, 6]], params)     # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

import torch

from tokenmill.engines.base import EngineUnavailable, call_seed
from tokenmill.sandbox.lifetime import parent_env, preexec_die_with_parent, stop_process, watch_parent
from tokenmill.types import Completion, SamplingParams

START_TIMEOUT_S = 300.0  # a new worker imports torch and transformers, then unpickles the model


def staging_views(buffer, layout: list[tuple[str, str, tuple[int, ...], int]]) -> dict[str, torch.Tensor]:
    """Tensors over `buffer` (a shared-memory block): (name, dtype name, shape, byte offset) each."""
    views = {}
    for name, dtype_name, shape, offset in layout:
        views[name] = torch.frombuffer(buffer, dtype=getattr(torch, dtype_name), count=math.prod(shape),
                                       offset=offset).view(shape)
    return views


class WorkerEngine:
    """`InferenceEngine` whose `HFEngine` runs in a worker process (CPU); see the module docstring.

    version: the version of the weights the worker samples from (set by `apply_staged`)
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, seed: int = 0, threads: int = 1,
                 fast_decode: bool = True, max_batch_tokens: int = 0, timeout_s: float = 120.0,
                 version: int = 0, engine_options: dict | None = None, vision: bool = False) -> None:
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ValueError(f"the worker engine runs on the CPU (the model is on {device})")
        self.timeout_s, self.version, self.closed = timeout_s, version, False
        self.takes_images = vision  # `rollout.generator.build_generator` then sends each prompt's images
        self._staged = version
        self._pipe = threading.Lock()  # one request on the socket at a time
        self._stage = threading.Lock()  # a push and the worker's load of the block never overlap
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        layout, offset = [], 0
        for name, p in trained:
            layout.append((name, str(p.dtype).removeprefix("torch."), tuple(p.shape), offset))
            offset += (p.numel() * p.element_size() + 63) // 64 * 64
        self._shm = shared_memory.SharedMemory(create=True, size=max(offset, 64))
        self.staging = staging_views(self._shm.buf, layout)
        mine, theirs = socket.socketpair()
        env = parent_env(dict(os.environ, OMP_NUM_THREADS=str(threads)))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.engines.local.worker", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env, preexec_fn=preexec_die_with_parent())  # noqa: PLW1509 - prctl and getppid only
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        finally:
            theirs.close()
        self._conn = Connection(os.dup(mine.fileno()))
        mine.close()
        opts = {"threads": threads, "seed": seed, "fast_decode": fast_decode, "max_batch_tokens": max_batch_tokens,
                "version": version, "engine_options": engine_options or {}, "vision": vision}
        try:
            # the module by value (plain pickle: its tensors are copied, nothing of the trainer's is shared)
            self._conn.send_bytes(pickle.dumps((pickle.dumps(model), tokenizer, self._shm.name, layout, opts)))
            self.pad_id = self._call(None, START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _call(self, request: tuple | None, timeout_s: float) -> Any:
        """Send `request` (None: only read the next answer) and return the worker's answer (the caller holds
        `self._pipe`, or is the constructor). A worker that does not answer in time is killed: its late
        answer would otherwise be read as the next request's."""
        if self.closed:
            raise EngineUnavailable("the worker engine is closed")
        try:
            if request is not None:  # plain pickle: tensors (a prompt's pixels) by value, not as shared handles
                self._conn.send_bytes(pickle.dumps(request))
            if not self._conn.poll(timeout_s):
                self.process.kill()
                raise EngineUnavailable(self._state(f"no answer within {timeout_s:g}s; killed"))
            status, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineUnavailable(self._state(f"connection lost ({type(exc).__name__})")) from None
        if status != "ok":
            raise EngineUnavailable(f"the worker engine (pid {self.process.pid}) failed: {payload}")
        return payload

    def _state(self, what: str) -> str:
        code = self.process.poll()
        alive = "still running" if code is None else f"exited with code {code}"
        return f"the worker engine (pid {self.process.pid}, {alive}): {what}"

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list | None = None) -> list[list[Completion]]:
        """`images`: a vision worker's per-prompt `ImageInputs` (or None), sent without their source pictures."""
        request: tuple = ("generate", [list(p) for p in prompts], params)
        if self.takes_images:
            images = images if images is not None else [getattr(p, "images", None) for p in prompts]
            request += ([None if x is None else replace(x, pictures=()) for x in images],)
        with self._pipe:
            return self._call(request, self.timeout_s)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stage the tensors (names as the model's `named_parameters`; the ones that train); the worker loads
        them at the next `apply_staged`. Never waits for a rollout; only for a load in progress (a memory copy)."""
        with self._stage, torch.no_grad():
            for name, tensor in named_tensors:
                target = self.staging.get(name)
                if target is None:
                    raise KeyError(f"tensor {name!r}: not a trainable parameter of the worker's model")
                target.copy_(tensor.detach())
            self._staged = version

    def apply_staged(self) -> bool:
        """Have the worker load the staged weights if they are newer than its own; True when it did."""
        with self._pipe, self._stage:
            if self._staged == self.version:
                return False
            self.version = self._call(("apply", self._staged), self.timeout_s)
            return True

    def state_dict(self) -> dict[str, Any]:
        return {}  # sampling is seeded per call (module docstring)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        """Stop the worker (a clean exit, else a kill after 10 s) and free the staging memory; idempotent."""
        if self.closed:
            return
        if self.process.poll() is None:
            if self._pipe.acquire(timeout=10.0):  # a rollout in flight (a closing producer) ends first
                try:
                    self._call(("close",), 10.0)
                except EngineUnavailable:
                    pass
                finally:
                    self._pipe.release()
            else:
                self.process.kill()
        self.closed = True
        self._conn.close()
        stop_process(self.process, terminate=False)  # it was asked to exit (or killed) above
        self._shm.close()
        self._shm.unlink()


# ------------------------------------------------------------------------------------------ the worker side
def _serve(conn: Connection) -> None:
    """The worker's loop: one request at a time from the socket, one answer each, until it closes."""
    from tokenmill.engines.local.hf import HFEngine

    replica, tokenizer, shm_name, layout, opts = pickle.loads(conn.recv_bytes())
    torch.set_num_threads(opts["threads"])
    try:
        shm = shared_memory.SharedMemory(name=shm_name)
        resource_tracker.unregister(shm._name, "shared_memory")  # the trainer owns (and unlinks) the block
        model = pickle.loads(replica).eval().requires_grad_(False)
        if opts["vision"]:
            from tokenmill.engines.local.vision import VisionEngine

            engine = VisionEngine(model, tokenizer, seed=opts["seed"])
        else:
            engine = HFEngine(model, tokenizer, seed=opts["seed"], fast_decode=opts["fast_decode"],
                              max_batch_tokens=opts["max_batch_tokens"], **opts["engine_options"])
        engine.version = opts["version"]
        own = dict(model.named_parameters())
        targets = [(own[name], view) for name, view in staging_views(shm.buf, layout).items()]
    except Exception as exc:  # noqa: BLE001 - sent to the trainer, which raises it with the worker named
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", engine.pad_id))
    calls = 0
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):  # the trainer went away
            return
        try:
            if kind == "close":
                conn.send(("ok", None))
                return
            if kind == "apply":
                with torch.no_grad():
                    for target, view in targets:
                        target.copy_(view)
                engine.version, calls = args[0], 0
                reply: Any = engine.version
            elif kind == "generate":
                prompts, params, *images = args  # a vision worker's: each prompt's ImageInputs
                engine.generator.manual_seed(call_seed(opts["seed"], engine.version, calls))
                calls += 1
                reply = engine.generate(prompts, params, *images)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # noqa: BLE001 - one failed request, answered; the worker serves on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", reply))


if __name__ == "__main__":
    watch_parent()
    _serve(Connection(int(sys.argv[1])))
