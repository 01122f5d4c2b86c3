"""Weight sync into vLLM servers, over the routes and worker methods `launch` names: `VLLMReloadSync`
(`engine.sync: vllm`, a safetensors folder each server reloads), `VLLMBroadcastSync` (`engine.sync:
vllm_broadcast`, a gloo broadcast into tokenmill's worker extension, `worker_ext.py`) and `VLLMLoRASync` (the
LoRA adapters only, loaded under `LORA_ADAPTER_NAME`)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.engines.vllm.launch import (
    COLLECTIVE_RPC,
    JOIN_METHOD,
    LEAVE_METHOD,
    LOAD_LORA_ADAPTER,
    LORA_ADAPTER_NAME,
    PAUSE,
    READY_METHOD,
    RECEIVE_METHOD,
    RELOAD_METHOD,
    RESET_PREFIX_CACHE,
    RESUME,
    UPDATE_WEIGHT_VERSION,
    WORKER_EXTENSION,
    WORKER_EXTENSION_FLAG,
)
from tokenmill.sync.base import NamedTensors, WeightSyncError
from tokenmill.sync.broadcast import BroadcastSync
from tokenmill.sync.files import write_folder
from tokenmill.sync.http import PushFailed, Servers, collect


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
    tokenmill_vllm_worker.TokenmillWeightReceiver` with `engines/vllm/worker_ext.py` on the server's PYTHONPATH
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

