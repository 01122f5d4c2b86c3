"""The process group of a multi-process run (torchrun, or one spawned by a test or by Ray) and the few
rank-aware pieces the loop needs: who logs, how a step's prompts are shared out, how per-rank state is kept.

With one process (no torchrun, no group) every helper answers as rank 0 of 1, so code that calls them runs
unchanged in a single process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.engines.base import call_seed
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.vision import VisionEngine
from tokenmill.types import Completion, ConfigError, Group, SamplingParams

# A collective that waits longer than this raises instead of hanging: long enough for rank 0's held-out
# evaluation and export (the other ranks wait for it at the next collective), short enough to end a job
# whose peer died without closing its sockets.
DEFAULT_TIMEOUT_S = 1800


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, init_method: str | None = None,
                     rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Join (or reuse) the default process group: gloo on CPU, NCCL with CUDA. Without `init_method` the
    torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says where; return (rank, world)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if init_method is None and "RANK" not in os.environ:
        raise ConfigError(
            "training.backend: fsdp2 needs a process group: launch with torchrun "
            "(torchrun --standalone --nproc_per_node N -m tokenmill train cfg.yaml)"
        )
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    given = {"init_method": init_method, "rank": rank, "world_size": world_size}
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            **{k: v for k, v in given.items() if v is not None})
    return dist.get_rank(), dist.get_world_size()


def rank() -> int:
    """This process's rank: the group's, or before it is joined torchrun's RANK (so a rank-0-only logger can
    be decided first); 0 in a single process."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Rank 0: the one that logs, evaluates, writes checkpoints' full weights and the final export."""
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (a collective)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ShardedRollout:
    """Each rank plays its contiguous share of a step's rows (group ids stay those of one process), then
    every rank receives all the groups, in row order, so the update sees the global batch everywhere.
    The metrics are rank 0's. With a `RankedEngine`, each prompt is sampled from the seed of its index among
    the step's rows, whichever rank plays it, so the global batch does not depend on the number of ranks."""

    def __init__(self, inner, engine: RankedEngine | None = None) -> None:
        self.inner = inner
        self.engine = engine
        self._rows = (-1, 0)  # (engine version, rows rolled out at it by all the ranks together)

    def rollout(self, rows: Sequence[dict[str, Any]], version: int, first_group: int = 0
                ) -> tuple[list[Group], dict[str, float]]:
        r, n = rank(), world()
        lo, hi = len(rows) * r // n, len(rows) * (r + 1) // n
        groups: list[Group] = []
        info: dict[str, float] = {}
        engine = self.engine
        if engine is not None:  # its first row's index among the rows of this version (rank 0's sampled
            # held-out evaluation, drawn on rank 0 only, moves no rank's count)
            seen = self._rows[1] if self._rows[0] == engine.version else 0
            self._rows = (engine.version, seen + len(rows))
            engine.drawn = seen + lo
        if hi > lo:
            groups, info = self.inner.rollout(list(rows[lo:hi]), version=version, first_group=first_group + lo)
        parts = gather_objects((groups, info))
        return [g for part, _ in parts for g in part], parts[0][1]


class PromptSeeded:
    """An in-process engine on one rank (mixed into `HFEngine` or `VisionEngine`). A sampled (not greedy) call
    draws each prompt on its own, from the seed `call_seed(seed, version, index)`, where index is the prompt's
    position among the prompts drawn since the last weight update (`ShardedRollout` starts a rank's count at
    its first row's position in the step), so a prompt's samples are the same whichever rank draws it and
    however many ranks there are. Greedy calls (the held-out evaluation) are batched as usual. A checkpoint
    keeps every rank's RNG as before (a resumed run reseeds each prompt the same way: the version comes back
    with the weights)."""

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, seed=seed, **kwargs)
        self.seed = seed
        self.drawn = 0  # prompts drawn since the last weight update (by all the ranks, up to this rank's turn)

    def generate(self, prompts: list[list[int]], params: SamplingParams, **images: Any) -> list[list[Completion]]:
        """`images`: a vision engine's `images=` (each prompt's `ImageInputs`), passed on prompt by prompt."""
        if params.greedy:
            return super().generate(prompts, params, **images)
        pictures = images.get("images")
        out: list[list[Completion]] = []
        for i, prompt in enumerate(prompts):  # alone: its draws depend on nothing but its seed
            self.generator.manual_seed(call_seed(self.seed, self.version, self.drawn))
            self.drawn += 1
            out += super().generate([prompt], params, **({} if pictures is None else {"images": [pictures[i]]}))
        return out

    def update_weights(self, named_tensors, version: int) -> None:
        super().update_weights(named_tensors, version)
        self.drawn = 0

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": gather_objects(super().state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state.get("ranks")
        super().load_state_dict(ranks[rank() % len(ranks)] if ranks else state)


class RankedEngine(PromptSeeded, HFEngine):
    """The text engine of one rank, each prompt drawn from its own seed (`PromptSeeded`)."""


class RankedVisionEngine(PromptSeeded, VisionEngine):
    """A vision-language policy's engine on one rank, each prompt (with its pictures) drawn from its own seed."""


class QuietLogger:
    """The metrics logger of ranks other than 0: rank 0 writes metrics, samples and messages for the run."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass
