"""A torch.distributed group for weight broadcast that leaves the default process group alone.

Why not `torch.distributed.init_process_group`: the trainer may already run inside one (FSDP) and an engine
server must never own one, so the weight group is built from its parts, a `TCPStore` hosted by the trainer
(rank 0) and a gloo (CPU) or NCCL (GPU) backend constructed on it directly. The store keys are laid out as
`torch.distributed`'s own group helper lays them out under the prefix SGLang's `init_custom_process_group`
adds (`<group_name>` then `<group_name>/` then `<device>/`), so an SGLang server joining by
`/init_weights_update_group` meets the trainer's keys. Every collective waits at most `timeout_s`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore, TCPStore

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


# vLLM's init_info carries no group name: its routes use this one (one vLLM-shaped group per server)
VLLM_GROUP = "vllm_weight_transfer"


def parse_dtype(name: str) -> torch.dtype:
    """'float32' or 'torch.float32' (SGLang and vLLM send either) -> torch.float32; ValueError names it."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (expected one of {sorted(_DTYPES)})")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_ALIGN = 64  # each packed tensor starts at a multiple of this many bytes (any dtype can view it)


def pack_plan(shapes: list[list[int]], dtypes: list[torch.dtype], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """How a packed push lays tensors out: buckets of (tensor index, byte offset), each bucket one uint8 buffer
    of at most `bucket_bytes` (a larger tensor gets a bucket of its own), in the tensors' order. The sender
    and every receiver compute the same plan from the push's shapes and dtypes."""
    buckets: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        size = math.prod(shape) * dtype.itemsize
        if buckets[-1] and used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((i, used))
        used += -(-size // _ALIGN) * _ALIGN
    return buckets if buckets[-1] else []


def bucket_length(plan_bucket: list[tuple[int, int]], shapes: list[list[int]], dtypes: list[torch.dtype]) -> int:
    """The byte length of one bucket of `pack_plan` (its last tensor's end)."""
    i, offset = plan_bucket[-1]
    return offset + math.prod(shapes[i]) * dtypes[i].itemsize


@dataclass
class WeightGroup:
    """One rank's handle on the weight group: `broadcast` from rank 0, bounded by the group timeout."""

    backend: object  # ProcessGroupGloo or ProcessGroupNCCL
    store: TCPStore
    rank: int
    world_size: int
    timeout_s: float

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.backend.broadcast([tensor], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if callable(shutdown):  # NCCL frees its communicator; gloo sockets close with the object
            try:
                shutdown()
            except RuntimeError:  # already aborted by a failed collective
                pass
        self.backend = None


def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float) -> TCPStore:
    """The trainer's side of the rendezvous; port 0 picks a free port (read it back from `store.port`).
    Does not wait for the other ranks: `open_group` does, bounded by the timeout."""
    return TCPStore(master_address, master_port, world_size, True,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def open_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
    timeout_s: float, store: TCPStore | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0, `store` from `host_store`) the group; blocks until every rank has
    joined or `timeout_s` passes (torch raises DistStoreError naming the missing keys)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg = ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.group_name = group_name
        pg = ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return WeightGroup(pg, store, rank, world_size, timeout_s)


def receive_push(group: WeightGroup, dtypes: list[torch.dtype], shapes: list[list[int]], device: str | torch.device,
             packed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """A receiver's side of one push: (index, tensor) for each tensor as it comes off the broadcast from rank 0,
    one receive per tensor, or with `packed` (the push's bucket_bytes) one per bucket of `pack_plan`, viewed
    back into its tensors (views of the bucket: copy them before the next one arrives if they must outlive it)."""
    if not packed:
        for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
            buf = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(buf, src=0)
            yield i, buf
        return
    for bucket in pack_plan(shapes, dtypes, packed):
        buf = torch.empty(bucket_length(bucket, shapes, dtypes), dtype=torch.uint8, device=device)
        group.broadcast(buf, src=0)
        for i, offset in bucket:
            size = math.prod(shapes[i]) * dtypes[i].itemsize
            yield i, buf[offset : offset + size].view(dtypes[i]).view(shapes[i])
