"""The server's receiving side of weight sync: SGLang- and vLLM-shaped HTTP routes over `engine.update_weights`.

    POST /update_weights_from_disk        {"model_path", "policy_version"?}              (SGLang shape)
    POST /init_weights_update_group       {"master_address", "master_port", "rank_offset", "world_size",
                                           "group_name", "backend"}                      (SGLang shape)
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "policy_version"?}
    POST /destroy_weights_update_group    {"group_name"}
    POST /init_weight_transfer_engine     {"init_info": {"master_address", "master_port", "rank_offset",
                                           "world_size", "backend"?}}                    (vLLM dev-mode shape)
    POST /update_weights                  {"update_info": {"names", "dtype_names", "shapes"}, "policy_version"?}
    GET  /get_world_size                  -> {"world_size": 1}

Each answers `{"success", "message", "policy_version"}`; 400 names the offending tensor or field, 504 a
transfer that timed out. Atomic: every tensor is read (from disk, or off the broadcast, which must be drained
anyway to keep the group in step) and checked against the engine's parameters (known name, same shape, same
dtype) before the engine gets any; a refused update leaves the old weights and version serving. An engine that
stages updates (`ContinuousEngine.stage_weights`) is answered without waiting for its running requests, which
finish on the old weights; requests after the answer run on the new ones (`WeightReceiver.apply`).
The version is `policy_version` (ours), else SGLang's `weight_version` when it is an integer, else +1.
Transfers run in a worker thread: the event loop keeps serving generation while a broadcast is received.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sync.group import VLLM_GROUP, WeightGroup, open_group, parse_dtype, receive_push
from tokenmill.types import TokenmillError


class UpdateRefused(TokenmillError, ValueError):
    """Bad input: the message names the tensor or field; the engine was not touched."""


# ------------------------------------------------------------------------------------------ request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy_version: int | None = Field(None, ge=0, description="Version the new weights make (ours).")
    weight_version: str | None = Field(None, description="SGLang's version label; used when an integer.")
    # SGLang request fields accepted for compatibility; this engine always drops stale prefix caches.
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class DiskBody(_Body):
    model_path: str = Field(..., min_length=1, description="Folder of .safetensors files (read-only).")


class GroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str = Field(..., min_length=1)
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=1, description="This server's rank (the trainer is rank 0).")
    world_size: int = Field(..., ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: str = Field("nccl", description="'gloo' (CPU) or 'nccl' (GPU).")


class DistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    bucket_bytes: int = Field(0, ge=0, description="tokenmill's packed pushes: the tensors come back to back "
                              "in uint8 buckets of at most this many bytes (`sync.group.pack_plan`); 0: one "
                              "broadcast per tensor (SGLang's way).")
    lora_scaling: float | None = Field(None, description="tokenmill's adapter-only pushes: the tensors are peft "
                                       "LoRA adapters (lora_A, lora_B) of the served model's linear layers; the "
                                       "server serves base + scaling * B @ A (`merge_adapters`).")


class DestroyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = "weight_update_group"


class WeightsByNameBody(BaseModel):
    """SGLang's `/get_weights_by_name`: the served parameter's first `truncate_size` rows (along dim 0)."""

    name: str
    truncate_size: int = Field(100, ge=1)


class VLLMInitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: GroupBody


class VLLMUpdateInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False


class VLLMUpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: VLLMUpdateInfo
    policy_version: int | None = Field(None, ge=0)


# ------------------------------------------------------------------------------------------ checks
def parameter_specs(engine) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, str]]:
    """(name -> (shape, dtype)) for every parameter name of the engine's model, aliases of tied weights
    included, and (alias -> canonical name) so that `lm_head.weight` reaches the embedding it is tied to."""
    model = engine.model
    canonical = {id(p): n for n, p in model.named_parameters()}
    specs, alias = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        specs[name] = (tuple(p.shape), p.dtype)
        alias[name] = canonical[id(p)]
    return specs, alias


def check_tensor(specs, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why `name` cannot be loaded into the engine, or None."""
    if name not in specs:
        return f"tensor {name!r}: no such parameter in the served model"
    want_shape, want_dtype = specs[name]
    if tuple(shape) != want_shape:
        return f"tensor {name!r}: shape {list(shape)} != the served model's {list(want_shape)}"
    if dtype != want_dtype:
        return f"tensor {name!r}: dtype {dtype} != the served model's {want_dtype} (cast on the sender)"
    return None


def _version(engine, policy_version: int | None, weight_version: str | None = None) -> int:
    if policy_version is not None:
        return policy_version
    if weight_version is not None and weight_version.isdigit():
        return int(weight_version)
    return latest_version(engine) + 1


def latest_version(engine) -> int:
    """The version of the last update received: staged and not applied yet (`ContinuousEngine`), or loaded."""
    return int(getattr(engine, "pending_version", engine.version))


def read_folder(path: str, specs) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every `.safetensors` file in `path`, checked against `specs`; never unpickles."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise UpdateRefused(f"model_path {path!r} is not a folder on this server")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UpdateRefused(f"model_path {path!r} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise UpdateRefused(f"{file.name}: unreadable safetensors file ({e})") from e
        for name, t in loaded.items():
            if name in tensors:
                raise UpdateRefused(f"tensor {name!r} appears in more than one file of {path!r}")
            why = check_tensor(specs, name, tuple(t.shape), t.dtype)
            if why:
                raise UpdateRefused(f"{file.name}: {why}")
            tensors[name] = t
    return list(tensors.items())


def merge_adapters(named: list[tuple[str, torch.Tensor]], scaling: float, engine,
                   base: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """peft LoRA adapters (`base_model.model.<layer>.lora_A.<adapter>.weight` and `lora_B`) as the plain weights
    they make: `<layer>.weight` = its base + (B @ A) * scaling, the order of peft's own merge. `base` keeps each
    adapted layer's weight as the engine held it at its first adapter push (the frozen base), so that later
    pushes replace the delta instead of adding to it. UpdateRefused names what does not fit."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        for part in ("lora_A", "lora_B"):
            if f".{part}." in name:
                layer = name.split(f".{part}.")[0].removeprefix("base_model.model.")
                pairs.setdefault(layer, {})[part] = tensor
                break
        else:
            raise UpdateRefused(f"tensor {name!r}: an adapter-only push carries lora_A and lora_B weights only")
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    merged = []
    for layer, ab in pairs.items():
        plain = f"{layer}.weight"
        if set(ab) != {"lora_A", "lora_B"}:
            raise UpdateRefused(f"layer {layer!r}: an adapter push needs both lora_A and lora_B")
        if plain not in params:
            raise UpdateRefused(f"layer {layer!r}: the served model has no {plain!r}")
        held = base.setdefault(plain, params[plain].detach().clone())
        delta = ab["lora_B"].to(held.dtype) @ ab["lora_A"].to(held.dtype)
        if delta.shape != held.shape:
            raise UpdateRefused(f"layer {layer!r}: B @ A is {tuple(delta.shape)}, the weight {tuple(held.shape)}")
        merged.append((plain, held + delta * scaling))
    return merged


# ------------------------------------------------------------------------------------------ the receiver
class WeightReceiver:
    """State behind the routes: the engine, its broadcast groups, and one lock so that updates never
    interleave. Methods are blocking; the routes run them in a worker thread."""

    def __init__(self, engine, *, timeout_s: float = 300.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.lock = threading.Lock()
        self.lora_base: dict[str, torch.Tensor] = {}  # adapted layers' weights before the first adapter push

    def apply(self, named: list[tuple[str, torch.Tensor]], version: int, alias: dict[str, str]) -> int:
        """Hand the checked tensors to the engine. One that stages updates (`ContinuousEngine`) takes them at
        once and applies them when its running requests are done: the answer then comes without waiting
        for them, so a trainer's push never waits for a rollout in flight (if nothing was running, it waits
        the moment it takes to apply, and /health shows the new version when the answer comes). `alias`: the
        second half of the `parameter_specs` the caller checked the tensors against."""
        named = [(alias[n], t) for n, t in named]
        stage = getattr(self.engine, "stage_weights", None)
        if stage is None:
            self.engine.update_weights(named, version)
            return version
        applied, busy = stage(named, version)
        if not busy:
            applied.wait(self.timeout_s)
        return version

    def from_disk(self, body: DiskBody) -> int:
        with self.lock:
            specs, alias = parameter_specs(self.engine)
            return self.apply(read_folder(body.model_path, specs),
                              _version(self.engine, body.policy_version, body.weight_version), alias)

    def init_group(self, body: GroupBody) -> None:
        with self.lock:
            old = self.groups.pop(body.group_name, None)
            if old is not None:  # the trainer re-forms the group (after a failure, or it restarted)
                old.close()
            if body.rank_offset >= body.world_size:
                raise UpdateRefused(f"rank_offset {body.rank_offset} outside world_size {body.world_size}")
            try:
                group = open_group(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                   body.group_name, body.backend, self.timeout_s)
            except ValueError as e:
                raise UpdateRefused(f"backend: {e}") from e
            self.groups[body.group_name] = group

    def destroy_group(self, group_name: str) -> None:
        with self.lock:
            group = self.groups.pop(group_name, None)
            if group is None:
                raise UpdateRefused(f"group_name {group_name!r}: no such group on this server")
            group.close()

    def from_broadcast(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       policy_version: int | None, weight_version: str | None = None, bucket_bytes: int = 0,
                       lora_scaling: float | None = None) -> int:
        """Receive `names` in order from rank 0. Every tensor is received even after a bad one, so that the
        trainer's broadcast completes and the group stays usable; then all or nothing is applied."""
        with self.lock:
            group = self.groups.get(group_name)
            if group is None:
                raise UpdateRefused(f"group_name {group_name!r}: call the init route first")
            if not len(names) == len(dtypes) == len(shapes):
                raise UpdateRefused(f"names, dtypes and shapes differ in length "
                                    f"({len(names)}, {len(dtypes)}, {len(shapes)})")
            try:
                parsed = [parse_dtype(d) for d in dtypes]
            except ValueError as e:
                raise UpdateRefused(f"dtypes: {e}") from e
            specs, alias = parameter_specs(self.engine)
            device = "cuda" if _is_nccl(group) else "cpu"
            errors, received = [], []
            try:
                pushed = receive_push(group, parsed, shapes, device, bucket_bytes)
                if lora_scaling is not None:  # adapters: received whole, then merged into the plain weights
                    merged = merge_adapters([(names[i], t.clone()) for i, t in pushed], lora_scaling, self.engine,
                                            self.lora_base)
                    names, shapes, parsed = ([n for n, _ in merged], [list(t.shape) for _, t in merged],
                                             [t.dtype for _, t in merged])
                    pushed = ((i, t) for i, (_, t) in enumerate(merged))
                for i, tensor in pushed:
                    why = check_tensor(specs, names[i], tuple(shapes[i]), parsed[i])
                    if why:
                        errors.append(why)
                    else:
                        received.append((names[i], tensor))
            except RuntimeError:  # a failed collective leaves the group unusable: the trainer must re-init
                self.groups.pop(group_name).close()
                raise
            if errors:
                more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
                raise UpdateRefused("; ".join(errors[:5]) + more)
            return self.apply(received, _version(self.engine, policy_version, weight_version), alias)


def _is_nccl(group: WeightGroup) -> bool:
    return type(group.backend).__name__ == "ProcessGroupNCCL"


# ------------------------------------------------------------------------------------------ routes
async def _run(receiver: WeightReceiver, fn, *args) -> JSONResponse:
    """Run a blocking update in a thread; map outcomes onto the `{"success", "message", "policy_version"}`
    answer: 400 refused input, 504 a group that timed out, 500 anything else (the cause in the message)."""
    try:
        await asyncio.to_thread(fn, *args)
    except UpdateRefused as e:
        return _answer(receiver, False, str(e), 400)
    except (RuntimeError, OSError) as e:  # torch.distributed timeouts and broken peers are RuntimeErrors
        timed_out = "timeout" in str(e).lower() or "timed out" in str(e).lower()
        return _answer(receiver, False, f"{type(e).__name__}: {str(e)[:500]}", 504 if timed_out else 500)
    return _answer(receiver, True, "ok", 200)


def _answer(receiver: WeightReceiver, success: bool, message: str, status: int) -> JSONResponse:
    body: dict[str, Any] = {"success": success, "message": message, "policy_version": latest_version(receiver.engine)}
    return JSONResponse(body, status_code=status)


def _memory_turn(receiver: WeightReceiver, method: str) -> dict[str, Any]:
    """SGLang's memory routes over the engine's `release_memory` / `restore_memory` (a colocated engine lets
    the trainer beside it have the device during the update; the weights stay). Call them between rollouts.
    An engine without the method answers success with `supported: false` (nothing held to let go)."""
    fn = getattr(receiver.engine, method, None)
    if fn is None:
        return {"success": True, "supported": False, "message": f"the engine has no {method}"}
    with receiver.lock:
        freed = fn()
    return {"success": True, "supported": True, "released_bytes": freed if isinstance(freed, int) else 0,
            "releases": getattr(receiver.engine, "memory_releases", None)}


def weight_routes(engine, *, timeout_s: float = 300.0) -> APIRouter:
    """The weight-update routes for `engine` (anything with `.model`, `.version` and `update_weights`).
    `timeout_s` bounds joining a group and each broadcast."""
    receiver = WeightReceiver(engine, timeout_s=timeout_s)
    router = APIRouter()

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskBody) -> JSONResponse:
        return await _run(receiver, receiver.from_disk, body)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(body: GroupBody) -> JSONResponse:
        return await _run(receiver, receiver.init_group, body)

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyBody) -> JSONResponse:
        return await _run(receiver, receiver.destroy_group, body.group_name)

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: DistributedBody) -> JSONResponse:
        return await _run(receiver, receiver.from_broadcast, body.group_name, body.names, body.dtypes,
                          body.shapes, body.policy_version, body.weight_version, body.bucket_bytes, body.lora_scaling)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: VLLMInitBody) -> JSONResponse:
        info = body.init_info.model_copy(update={"group_name": VLLM_GROUP})
        return await _run(receiver, receiver.init_group, info)

    @router.post("/update_weights")
    async def update_weights(body: VLLMUpdateBody) -> JSONResponse:
        info = body.update_info
        if info.packed:
            return _answer(receiver, False, "update_info.packed: packed transfers are not supported here", 400)
        return await _run(receiver, receiver.from_broadcast, VLLM_GROUP, info.names, info.dtype_names,
                          info.shapes, body.policy_version)

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, int]:
        return {"world_size": 1}

    @router.post("/get_weights_by_name")
    async def get_weights_by_name(body: WeightsByNameBody) -> JSONResponse:
        """What the server samples from, to check a sync (SGLang's route): the rows as nested lists of floats
        (exact: a float32 goes to JSON as the float64 it widens to), 404 for a name the model lacks."""
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        if body.name not in params:
            return JSONResponse({"success": False, "message": f"no parameter {body.name!r}"}, status_code=404)
        with receiver.lock:  # not while an update is being applied
            rows = params[body.name].detach()[: body.truncate_size].float().cpu().tolist()
        return JSONResponse(rows)

    @router.post("/release_memory_occupation")
    async def release_memory_occupation() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(_memory_turn, receiver, "release_memory"))

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(_memory_turn, receiver, "restore_memory"))

    router.receiver = receiver  # type: ignore[attr-defined]  # for tests and the server's shutdown
    return router
