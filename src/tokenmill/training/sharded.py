"""FSDP2 training backend: every rank trains a shard of the model with exactly `LocalBackend`'s update code.

    >>> init_distributed()                                   # torchrun's environment     # doctest: +SKIP
    >>> backend = ShardedBackend(model, learning_rate=1e-5, total_steps=100,
    ...                          checkpoint_dir="out/checkpoints/shards")             # doctest: +SKIP
    >>> backend.forward_backward(global_batch, loss_fn)      # on every rank, same batch  # doctest: +SKIP

Every rank receives the same *global* batch and trains on its part of it:

- whole prompt groups go to a rank (so shared-prompt packing keeps working), balanced by token count;
- the loss weights were computed over the global batch (`token_weights` before the split), so each rank's
  loss is its share of one global sum, and gradients are SUMMED across ranks (FSDP2 averages by default;
  averaging would divide the update by the world size);
- FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in every backward, so every
  rank must run the same number of micro-batches: a rank with fewer runs zero-weight ones (zero gradient),
  or the collectives stop pairing up and the job hangs;
- `clip_grad_norm_` over the sharded gradients uses the global norm; the optimiser (fused AdamW where it
  can) steps each rank's shard.

Checkpoints are sharded (`torch.distributed.checkpoint`: each rank writes its own part, and a later run may
load them with another world size). Full weights are gathered one parameter at a time (`weights()`), so the
peak extra memory is one full tensor.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tokenmill.engines.local.vision import vision_tower
from tokenmill.training.base import BatchLoss
from tokenmill.training.batch import Batch, greedy_spans
from tokenmill.training.critic import Critic
from tokenmill.training.dist import (
    barrier,
    gather_objects,
    init_distributed,
    is_main,
    max_over_ranks,
    rank,
    world,
)
from tokenmill.training.local import LocalBackend, ReferenceModel, packing_segments
from tokenmill.training.logprobs import DEFAULT_CHUNK_MIB
from tokenmill.training.packing import plan_lines, prompt_segments
from tokenmill.types import ConfigError, TokenmillError

SHARDS_PREFIX = "optim-step-"
CRITIC_SHARDS_PREFIX = "critic-step-"


class ShardedCheckpointError(TokenmillError):
    """A sharded checkpoint cannot be written or read (no directory given, or its shards are gone)."""


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 in place: each decoder layer is its own unit (gathered only while it runs), then the root (the
    embeddings and head). Gradients are summed across ranks (see the module docstring).

    A vision-language model's frozen vision tower is not sharded: every rank keeps the whole of it, without
    gradients, so a micro-batch without pictures and one with them run the same collectives. A tower that
    trains (`model.freeze_vision: false`) is part of the root unit, gathered with the embeddings."""
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    tower = vision_tower(model)
    held = {p for p in tower.parameters() if not p.requires_grad} if tower is not None else set()
    fully_shard(model, mesh=mesh, ignored_params=held or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # gloo has no PREMUL_SUM, which a divide factor of 1 would otherwise use; SUM works everywhere
            module.set_force_sum_reduction_for_comms(True)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the children of the `ModuleList` named `layers` (Llama, Qwen, Mistral...),
    `h` (GPT-2) or `blocks`, wherever a wrapper (peft, a value head) put it; a vision-language model's
    language layers, not its vision tower's blocks."""
    tower = vision_tower(model)
    inside_tower = set(tower.modules()) if tower is not None else set()
    for name, module in model.named_modules():
        if module in inside_tower:
            continue
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(module)
    return []


def root_forward(model: torch.nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` run as the forward of `model` when it is an FSDP2 root: its hooks gather the root
    unit's weights (embeddings, head, a trainable vision tower) around it and set up the backward, which a
    forward that does not go through `model(...)` (the vision-language path's own embedding of the pictures,
    `engines.local.vision.backbone`) would otherwise miss. A plain call for any other module."""
    if not isinstance(model, FSDPModule):
        return fn(*args, **kwargs)
    model.forward = lambda: fn(*args, **kwargs)  # an instance attribute: `model()` runs it inside the hooks
    try:
        return model()
    finally:
        del model.forward


def rank_rows(batch: Batch, ranks: int) -> list[list[int]]:
    """Rows of `batch` for each rank: whole prompt groups (rows with the same prompt stay together), the
    largest first to the least-loaded rank (by tokens); each rank's rows in batch order (longest first)."""
    if batch.prompt_lens_B is not None:
        segments = [rows for _, rows in prompt_segments(batch)]
        if batch.images_B is not None:  # the same prompt tokens over other pictures: another prompt
            segments = [part for rows in segments for part in _by_pictures(batch.images_B, rows)]
    else:
        segments = [[b] for b in range(batch.size)]
    lengths = batch.lengths_B.tolist()
    cost = [sum(lengths[b] for b in rows) for rows in segments]
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(segments)), key=lambda i: -cost[i]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r] += segments[i]
        load[r] += cost[i]
    return [sorted(rows) for rows in out]


def _by_pictures(images_B: tuple, rows: list[int]) -> list[list[int]]:
    """`rows` split by the pictures they carry, in first-seen order. A group's samples share one `ImageInputs`
    object, and every rank's global batch has the same sharing (all ranks unpickle the same gathered groups),
    so the split agrees across ranks without reading the pixels."""
    parts: dict[int, list[int]] = {}
    for b in rows:
        parts.setdefault(id(images_B[b]), []).append(b)
    return list(parts.values())


def micro_batch_count(batch: Batch | None, token_budget: int, *, share_prompts: bool, pack_sequences: bool) -> int:
    """How many forward passes `micro_token_stats` makes over `batch`, without running the model (the same
    choice of packing and the same `greedy_spans` as `micro_packs` / `Batch.micro_batches`)."""
    if batch is None:
        return 0
    segments = packing_segments(batch, share_prompts=share_prompts, pack_sequences=pack_sequences)
    if segments is None:
        widths = batch.lengths_B.tolist()  # sorted longest first, like the rows
    else:
        widths = [width for width, _ in plan_lines(batch, token_budget, segments)]  # widest first
    return len(greedy_spans(widths, token_budget))


def _dummy(batch: Batch) -> Batch:
    """One row of `batch` with zero loss weights: one forward/backward with the collectives of a real
    micro-batch and exactly zero gradient."""
    row = batch.select([batch.size - 1])
    return replace(row, weights_B_T=torch.zeros_like(row.weights_B_T))


def split_logprobs(batch: Batch, logprobs: Callable[[Batch], torch.Tensor], token_budget: int,
                   share_prompts: bool) -> torch.Tensor:
    """`logprobs` (a no-grad forward over an FSDP2 module) of the global `batch`: each rank runs its rows, padded
    to the group's micro-batch count, and every rank receives all the rows."""
    rows = rank_rows(batch, world())[rank()]
    local = batch.select(rows) if rows else None
    count = micro_batch_count(local, token_budget, share_prompts=share_prompts, pack_sequences=False)
    padding = max_over_ranks(count) - count
    part = logprobs(local) if local is not None else None
    dummy = _dummy(batch)
    for _ in range(padding):
        logprobs(dummy)
    out = torch.zeros_like(batch.old_logprobs_B_T)
    for their_rows, their_part in gather_objects((rows, part)):
        if their_part is not None:
            out[their_rows, : their_part.shape[1]] = their_part
    return out


class ShardedReference(ReferenceModel):
    """The frozen initial policy for the KL term, sharded like the trainer (1/N of its weights per rank); each
    rank computes the reference logprobs of its rows of the global batch. Call on every rank. With
    `adapters_off`, `model` is a LoRA policy the trainer already sharded, run with its adapters disabled."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, token_budget: int,
                 share_prompts: bool = True, adapters_off: bool = False,
                 logits_chunk_mib: float = DEFAULT_CHUNK_MIB) -> None:
        super().__init__(model if adapters_off else shard_model(model.requires_grad_(False)),
                         temperature=temperature, token_budget=token_budget, share_prompts=share_prompts,
                         adapters_off=adapters_off, logits_chunk_mib=logits_chunk_mib)

    def forward(self, batch: Batch) -> torch.Tensor:
        return split_logprobs(batch, super().forward, self.token_budget, self.share_prompts)


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, name: str, keep: int) -> None:
    """Every rank writes its shard of `model` and `optimizer` to `folder/name` (a collective); rank 0 then
    removes all but the newest `keep` folders of the same kind (the name up to its step number)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / name))
    barrier()  # every shard is on disk before anyone records or prunes
    if is_main():
        kind = name.rstrip("0123456789")
        found = sorted(p for p in folder.glob(f"{kind}*") if p.is_dir())
        for stale in found[: max(0, len(found) - keep)]:
            shutil.rmtree(stale, ignore_errors=True)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read `save_shards`' folder into the sharded `model` and `optimizer` (any world size; a collective)."""
    if not (path / ".metadata").is_file():
        raise ShardedCheckpointError(f"sharded checkpoint {path} is missing (its .metadata is not there)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    barrier()


class ShardedBackend:
    """`TrainBackend` over an FSDP2-sharded module; call every verb on every rank with the same global batch.

    `model` is a full (unsharded) module, identical on every rank; it is sharded in place. `checkpoint_dir`
    (on a filesystem every rank sees) holds the sharded checkpoints that `state_dict()` writes; the newest
    `keep` of them are kept."""

    def __init__(self, model: torch.nn.Module, *, checkpoint_dir: str | Path | None = None, keep: int = 3,
                 **local_kwargs: Any) -> None:
        if local_kwargs.get("optimizer_offload"):  # its checkpoints map the optimiser's own parameters to the shards
            raise ValueError("training.optimizer_offload: the local backend only (training.backend: local); an "
                             "FSDP2 rank holds a shard of the optimiser state already")
        self.model = shard_model(model)
        self.local = LocalBackend(self.model, **local_kwargs)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep = keep

    @property
    def teacher_in_loss(self) -> bool:
        return self.local.teacher_in_loss

    # ------------------------------------------------------------------------------------------ training
    def _mine(self, batch: Batch) -> Batch | None:
        rows = rank_rows(batch, world())[rank()]
        return batch.select(rows) if rows else None

    def _padding(self, local: Batch | None, *, train: bool) -> int:
        """Zero-weight micro-batches this rank runs so that every rank runs as many as the busiest one."""
        count = micro_batch_count(
            local, self.local.micro_batch_tokens, share_prompts=self.local.share_prompts,
            pack_sequences=self.local.pack_sequences and train,
        )
        return max_over_ranks(count) - count

    def forward_backward(self, batch: Batch, loss_fn: BatchLoss, entropy_coef: float = 0.0) -> dict[str, float]:
        """This rank's share of the global batch, padded to the group's micro-batch count; the metrics summed
        over all ranks (what `LocalBackend` returns for the whole batch)."""
        local = self._mine(batch)
        padding = self._padding(local, train=True)
        totals = self.local.forward_backward(local, loss_fn, entropy_coef) if local is not None else {}
        dummy = _dummy(batch)
        for _ in range(padding):
            self.local.forward_backward(dummy, loss_fn, entropy_coef)  # its metrics are zero: dropped
        summed: dict[str, float] = {}
        for part in gather_objects(totals):
            for k, v in part.items():
                summed[k] = summed.get(k, 0.0) + v
        return summed

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logprobs of the global batch: each rank computes its rows, then every rank gets all of them."""
        return split_logprobs(batch, self.local.forward, self.local.micro_batch_tokens, self.local.share_prompts)

    def optim_step(self) -> dict[str, float]:
        return self.local.optim_step()

    # ------------------------------------------------------------------------------------------- weights
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full trained parameters by name, gathered one at a time (a collective: every rank must consume
        the whole iterator, in order). Each rank receives them, so each can refresh its own engine."""
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                data = p.detach()
                yield name, data.full_tensor() if isinstance(data, DTensor) else data

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, full and on the CPU, on rank 0 (empty elsewhere; a collective): for an export."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # ---------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Writes this rank's shard of the weights and optimiser state under `checkpoint_dir` (a collective)
        and returns what finds it again: the folder's name and the LR schedule."""
        if self.checkpoint_dir is None:
            raise ShardedCheckpointError("a sharded checkpoint needs the backend's checkpoint_dir")
        name = f"{SHARDS_PREFIX}{self.local.scheduler.last_epoch:08d}"
        save_shards(self.model, self.local.optimizer, self.checkpoint_dir, name, self.keep)
        return {"shards": name, "world_size": world(), "scheduler": self.local.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Read the shards `state` names into the sharded weights and optimiser (any world size)."""
        if self.checkpoint_dir is None:
            raise ShardedCheckpointError("a sharded checkpoint needs the backend's checkpoint_dir")
        load_shards(self.model, self.local.optimizer, self.checkpoint_dir / state["shards"])
        self.local.scheduler.load_state_dict(state["scheduler"])


class ShardedCritic(Critic):
    """PPO's value model sharded like the trainer: every rank computes the values of, and trains on, its rows
    of the global batch (micro-batches padded to the busiest rank's count; gradients summed). Its state is
    written as shards under `checkpoint_dir`, like the policy's."""

    def __init__(self, model: torch.nn.Module, *, checkpoint_dir: str | Path | None = None, keep: int = 3,
                 **kwargs: Any) -> None:
        super().__init__(shard_model(model), **kwargs)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep = keep

    def _split(self, batch: Batch) -> tuple[list[int], Batch | None, int]:
        rows = rank_rows(batch, world())[rank()]
        local = batch.select(rows) if rows else None
        count = micro_batch_count(local, self.micro_batch_tokens, share_prompts=self.share_prompts, pack_sequences=False)
        return rows, local, max_over_ranks(count) - count

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        rows, local, padding = self._split(batch)
        part = super().values(local) if local is not None else None
        for _ in range(padding):
            super().values(_dummy(batch))
        out = torch.zeros_like(batch.old_logprobs_B_T)
        for their_rows, their_part in gather_objects((rows, part)):
            if their_part is not None:
                out[their_rows, : their_part.shape[1]] = their_part
        return out

    def forward_backward(self, batch: Batch) -> dict[str, float]:
        _, local, padding = self._split(batch)
        totals = super().forward_backward(local) if local is not None else {}
        for _ in range(padding):
            super().forward_backward(_dummy(batch))  # zero weights: zero gradient, its metrics dropped
        summed: dict[str, float] = {}
        for part in gather_objects(totals):
            for k, v in part.items():
                summed[k] = summed.get(k, 0.0) + v
        return summed

    def state_dict(self) -> dict[str, Any]:
        if self.checkpoint_dir is None:
            raise ShardedCheckpointError("a sharded critic checkpoint needs the critic's checkpoint_dir")
        name = f"{CRITIC_SHARDS_PREFIX}{self.optim.scheduler.last_epoch:08d}"
        save_shards(self.model, self.optim.optimizer, self.checkpoint_dir, name, self.keep)
        return {"shards": name, "scheduler": self.optim.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.checkpoint_dir is None:
            raise ShardedCheckpointError("a sharded critic checkpoint needs the critic's checkpoint_dir")
        load_shards(self.model, self.optim.optimizer, self.checkpoint_dir / state["shards"])
        self.optim.scheduler.load_state_dict(state["scheduler"])


# ---------------------------------------------------------------------------- offline loops (sft, preference)
def launched() -> bool:
    """This process is one of several ranks: torchrun's WORLD_SIZE > 1, or a group of several already joined."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def offline_backend(model: torch.nn.Module, spec: Any) -> tuple[Any, torch.nn.Module]:
    """(backend, module to run forward passes on) of `spec` (`training.spec.TrainerSpec`) for an offline loop
    (`tokenmill sft`, `preference`): one process trains `model` itself with a `LocalBackend`; under torchrun
    (several ranks) a `ShardedBackend` trains a sharded copy, and `copy_back` refreshes `model` from it at the end
    (every rank holds it whole). A peft LoRA model shards the same way (only its adapters, and a classifier's
    head, train)."""
    from tokenmill.training.spec import policy_backend

    if not launched():
        return policy_backend(spec, model), model
    init_distributed()
    backend = policy_backend(spec, copy.deepcopy(model), sharded=True)
    return backend, backend.model


def copy_back(backend: Any, model: torch.nn.Module) -> None:
    """Load a `ShardedBackend`'s trained weights into the whole `model` on every rank (a collective); nothing
    to do for a `LocalBackend`, which trained `model` itself."""
    if not isinstance(backend, ShardedBackend):
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in backend.weights():
            params[name].copy_(full)


def my_share(items: list) -> list:
    """This rank's part of a list every rank holds (all of it in one process); refuses fewer items than ranks
    (a rank with nothing to compute would leave the others waiting in a collective)."""
    if len(items) < world():
        raise ConfigError(f"batch_size: {len(items)} item(s) per step cannot be shared by {world()} ranks; "
                          "use at least one per rank")
    return items[rank()::world()]


def sum_over_ranks(value: float) -> float:
    return float(sum(gather_objects(value)))
