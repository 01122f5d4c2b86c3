"""Weight sync by torch.distributed broadcast from the trainer (rank 0) to N engine servers (ranks 1..N).

Per push: the control call (which tensors, in which order, with which dtypes and shapes) goes to every
server over HTTP while the trainer broadcasts the tensors, concurrently, because each server's handler blocks
in its receive until the broadcast arrives. The group is opened once, in the constructor, the same way
(control call and rendezvous concurrently); it never touches the default process group, so it can live in
any process, FSDP trainers included. Every wait is bounded by `timeout_s`; a failed broadcast closes the group
and the next push opens a new one.

Two route shapes (`api=`), both served by tokenmill's own server (`tokenmill serve`):

- `"sglang"`: `POST /init_weights_update_group`, `/update_weights_from_distributed`,
  `/destroy_weights_update_group`. A real SGLang server: `python -m sglang.launch_server --model-path MODEL
  --host 127.0.0.1 --port 30000` (the routes are on by default) and `backend="nccl"`; the store keys follow
  SGLang's `init_custom_process_group` layout (see `sync/group.py`).
- `"vllm"`: `POST /init_weight_transfer_engine {"init_info"}`, `/update_weights {"update_info"}` (vLLM's
  dev-mode RLHF routes). A real vLLM server: `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config
  '{"backend": "nccl"}'` and `BroadcastSync(urls, api="vllm", backend="nccl", vllm_native=True)`: vLLM's
  receiver joins through its own `StatelessProcessGroup` + PyNccl, so the trainer must use vLLM's
  `NCCLWeightTransferEngine.trainer_init` (vllm importable in the trainer); a vLLM server with tensor
  parallelism takes `GET /get_world_size` ranks, which the rank offsets follow.

With `bucket_bytes` (tokenmill's own servers; the placements that spawn them turn it on) the tensors travel
packed back to back in uint8 buckets (`sync.group.pack_plan`): one message per bucket instead of one per
tensor, each of which a server busy generating must schedule its receiving thread for (measured on a
2-core CPU with a 20-tensor model: a push took 44 ms beside generation, one per tensor).

NCCL is written but not run in tokenmill's CI (no GPU there); gloo is tested against a server in another
process.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, Literal

import torch

from tokenmill.sync.base import NamedTensors, WeightSyncError, check_engine_names
from tokenmill.sync.group import (
    VLLM_GROUP,
    WeightGroup,
    bucket_length,
    dtype_name,
    host_store,
    open_group,
    pack_plan,
)
from tokenmill.sync.http import PushFailed, Servers, collect

PACKED_BUCKET_BYTES = 256 << 20  # a packed push's largest message (a bigger tensor goes alone)

_ROUTES = {
    "sglang": ("/init_weights_update_group", "/update_weights_from_distributed"),
    "vllm": ("/init_weight_transfer_engine", "/update_weights"),
}


class BroadcastSync:
    """`push` broadcasts `named_tensors` (cast to `dtype` if given) to every server in `urls`.

    `master_address` must be reachable from the servers (loopback when they run on this machine); port 0
    picks a free one. Raises `WeightSyncError` naming each server that refused or did not answer.
    `drop_failed`: a server that does not answer at all is dropped (logged), the group re-formed with the
    others and the push repeated, so a run survives a dead engine; a refusal (bad weights) always raises.
    `receivers`: that many more ranks, after the servers', that are no servers: they join the group themselves
    (`sync.group.open_group` with ranks `world - receivers ..`, while the constructor waits) and receive every
    push (`sync.group.receive_push`); such a group is not re-formed without them, so `drop_failed` is off.
    `lora_scaling`: the pushes are a peft LoRA model's adapters alone (lora_A, lora_B), which tokenmill's server
    merges into the base weights it holds (`weight_routes.merge_adapters`)."""

    def __init__(
        self,
        urls: list[str],
        *,
        api: Literal["sglang", "vllm"] = "sglang",
        backend: Literal["gloo", "nccl"] = "gloo",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "tokenmill_weights",
        token: str | None = None,
        timeout_s: float = 300.0,
        dtype: torch.dtype | None = None,
        vllm_native: bool = False,
        drop_failed: bool = False,
        bucket_bytes: int = 0,
        receivers: int = 0,
        lora_scaling: float | None = None,
    ) -> None:
        if api not in _ROUTES:
            raise ValueError(f"api must be 'sglang' or 'vllm', not {api!r}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
        if vllm_native and (api != "vllm" or backend != "nccl"):
            raise ValueError("vllm_native needs api='vllm' and backend='nccl'")
        if bucket_bytes and api != "sglang":
            raise ValueError("bucket_bytes (packed pushes) needs api='sglang' and tokenmill's server")
        if receivers and (drop_failed or api != "sglang"):
            raise ValueError("receivers (ranks that are no servers) need api='sglang' and drop_failed=False")
        self.bucket_bytes, self.receivers = bucket_bytes, receivers
        if lora_scaling is not None and api != "sglang":
            raise ValueError("lora_scaling (adapter-only pushes) needs api='sglang' and tokenmill's server")
        self.lora_scaling = lora_scaling  # pushes carry peft adapters, merged by the server (W + scaling * B @ A)
        self.servers = Servers(urls, token=token, timeout_s=timeout_s)
        self.api, self.backend, self.dtype = api, backend, dtype
        self.master_address, self.master_port = master_address, master_port
        self.group_name = VLLM_GROUP if api == "vllm" else group_name  # vLLM's routes name no group
        self.timeout_s, self.vllm_native, self.drop_failed = timeout_s, vllm_native, drop_failed
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.group: WeightGroup | _VLLMGroup | None = None
        self._dropping(self._open)

    # ---------------------------------------------------------------------------------------- the group
    def _ranks(self) -> tuple[list[int], int]:
        """Each server's first rank and the world size (a vLLM server may hold several ranks)."""
        sizes = [1] * len(self.servers.urls)
        if self.api == "vllm":
            sizes = [int(self.servers.client.get(u + "/get_world_size").json()["world_size"])
                     for u in self.servers.urls]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        return offsets, 1 + sum(sizes) + self.receivers

    def _route(self, which: int) -> str:
        """The HTTP route of the group's join (0) and of a push's control call (1); a subclass for another
        server's routes overrides it with `_init_body` and `_update_body`."""
        return _ROUTES[self.api][which]

    def _init_body(self, port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
        info = {"master_address": self.master_address, "master_port": port, "rank_offset": rank_offset,
                "world_size": world_size}
        if self.api == "vllm":
            if not self.vllm_native:
                info["backend"] = self.backend  # tokenmill's server also speaks gloo on these routes
            return {"init_info": info}
        return {**info, "group_name": self.group_name, "backend": self.backend}

    def _open(self) -> None:
        """Host the rendezvous, ask every server to join, join too (all three concurrently bounded)."""
        try:
            offsets, world = self._ranks()
        except Exception as e:
            raise WeightSyncError(f"GET /get_world_size failed: {type(e).__name__}: {e}") from e
        init_route = self._route(0)
        store = None
        if self.vllm_native:
            port = self.master_port or _free_port(self.master_address)
        else:
            store = host_store(self.master_address, self.master_port, world, self.timeout_s)
            port = store.port
        calls = [self.servers.submit(u, init_route, self._init_body(port, off, world))
                 for u, off in zip(self.servers.urls, offsets)]
        try:
            if self.vllm_native:
                self.group = _VLLMGroup(self.master_address, port, world)
            else:
                self.group = open_group(self.master_address, port, 0, world, self.group_name, self.backend,
                                        self.timeout_s, store=store)
        except Exception as e:
            try:
                collect(calls)
            except PushFailed as server_error:
                raise PushFailed(f"weight group did not form: {server_error}", server_error.unreachable,
                                 server_error.refused, server_error.only_unreachable) from e
            raise WeightSyncError(f"weight group did not form: {type(e).__name__}: {e}") from e
        collect(calls)

    def _dropping(self, fn, *args) -> None:
        """`fn(*args)`; with `drop_failed`, when servers did not answer (and none refused), drop them, re-form
        the group with the others and try again."""
        while True:
            try:
                return fn(*args)
            except PushFailed as e:
                if not (self.drop_failed and e.unreachable and not e.refused):
                    raise
                self.servers.drop(e.unreachable)
                if self.group is not None:
                    self.group.close()
                    self.group = None
                if fn != self._open:
                    self._dropping(self._open)

    # ---------------------------------------------------------------------------------------- pushes
    def _update_body(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        names = [n for n, _ in tensors]
        dtypes = [dtype_name(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        if self.api == "vllm":
            body: dict[str, Any] = {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}
            if not self.vllm_native:
                body["policy_version"] = int(version)
            return body
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                "policy_version": int(version), "weight_version": str(version)}
        if self.bucket_bytes:  # tokenmill's server only (SGLang's refuses the field)
            body["bucket_bytes"] = self.bucket_bytes
        if self.lora_scaling is not None:  # tokenmill's server only
            body["lora_scaling"] = self.lora_scaling
        return body

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        tensors = []
        for name, t in named_tensors if self.lora_scaling is not None else check_engine_names(named_tensors):
            t = t.detach().to(device=self.device, dtype=self.dtype or t.dtype)
            tensors.append((name, t.contiguous()))
        if self.group is None:
            self._dropping(self._open)
        self._dropping(self._push_once, tensors, version)

    def _push_once(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        body = self._update_body(tensors, version)
        calls = [self.servers.submit(u, self._route(1), body) for u in self.servers.urls]
        try:
            with torch.no_grad():
                for t in self._buffers(tensors):
                    self.group.broadcast(t, src=0)
        except RuntimeError as e:
            self.group.close()  # the servers' receives fail too, and they drop their end
            self.group = None
            try:
                collect(calls)
            except PushFailed as server_error:
                raise PushFailed(f"broadcast failed: {server_error}", server_error.unreachable,
                                 server_error.refused, server_error.only_unreachable) from e
            raise WeightSyncError(f"broadcast failed: {type(e).__name__}: {e}") from e
        collect(calls)

    def _buffers(self, tensors: list[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
        """What to broadcast, in order: each tensor, or with `bucket_bytes` the tensors packed into uint8
        buckets (`pack_plan`): a few large messages instead of one per tensor, each of which a busy server
        must schedule its receiving thread for."""
        if not self.bucket_bytes:
            yield from (t for _, t in tensors)
            return
        shapes, dtypes = [list(t.shape) for _, t in tensors], [t.dtype for _, t in tensors]
        for bucket in pack_plan(shapes, dtypes, self.bucket_bytes):
            buf = torch.empty(bucket_length(bucket, shapes, dtypes), dtype=torch.uint8, device=self.device)
            for i, offset in bucket:
                flat = tensors[i][1].reshape(-1).view(torch.uint8)
                buf[offset : offset + flat.numel()].copy_(flat)
            yield buf

    def close(self) -> None:
        if self.group is not None and self.api == "sglang":
            try:
                self.servers.post_all("/destroy_weights_update_group", {"group_name": self.group_name})
            except WeightSyncError:
                pass  # a server that is gone has no group to destroy
        if self.group is not None:
            self.group.close()
            self.group = None
        self.servers.close()


class _VLLMGroup:
    """The trainer's end of vLLM's own NCCL weight-transfer group (`StatelessProcessGroup` + PyNccl)."""

    def __init__(self, master_address: str, master_port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.comm = NCCLWeightTransferEngine.trainer_init(
            {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.comm = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
