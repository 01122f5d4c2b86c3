"""Trainer ranks as Ray actors: one `ShardedBackend` rank per actor, on the bundles of one placement group,
driven by the driver with the same global batch; torn down and rebuilt from the last sharded checkpoint when a
rank dies.

Why the whole group and not one rank: a torch.distributed group cannot take a restarted member back (the
survivors' sockets to the dead peer are broken), so a failure of any rank ends the group. The driver sees it
within a second or so (the dead actor's calls fail at once, the survivors' collectives fail on the reset
connection, and every wait has `cluster.call_timeout_s` as its limit), kills every rank, starts a new group on
the same placement group, loads the last checkpoint and goes on; at most `max_restarts` times, each logged. A
run never goes on with fewer ranks.

The ranks meet through a file in the checkpoint folder (torch's FileStore), so the group opens no rendezvous
port; their gloo/NCCL connections use the interface `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` name (loopback
on a local cluster).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.controller.ray.cluster import LOOPBACK, ClusterError, RayCluster, import_ray
from tokenmill.training.spec import TrainerSpec

log = logging.getLogger("tokenmill.controller.ray")


class RankFailure(ClusterError):
    """A trainer rank died or a call on the group failed or ran out of time: the group is unusable."""


@dataclass(frozen=True)
class BackendSpec:
    """What each rank builds: the model folder (same weights on every rank; the seed fixes any fresh heads),
    where the sharded checkpoints go (a filesystem every node sees), and the run's `TrainerSpec` (with
    distillation's full loss, each rank loads the teacher it names; `tokenizer_path` is the policy's tokenizer
    when it is not in the model folder)."""

    model_path: str
    checkpoint_dir: str
    seed: int = 0
    trainer: TrainerSpec = field(kw_only=True)
    tokenizer_path: str | None = None
    pg_timeout_s: float = 300.0  # a collective waiting longer than this raises in the rank
    # what each rank of the group builds (`controller.ray.roles`): "policy" (the trainer), "reference" (the KL
    # reference, sharded over the group), "critic" (PPO's value model, sharded over the group)
    roles: tuple[str, ...] = ("policy",)
    reference: dict[str, Any] | None = None  # the reference's forward settings (TrainerSpec.reference_kwargs)
    critic: Any = None  # a `controller.ray.roles.CriticSpec` when the group holds the critic
    lora: Any = None  # model.lora (a LoRAConfig with rank > 0): each rank wraps its model with the adapters
    freeze_vision: bool = True  # model.freeze_vision: a vision-language policy's tower held, as on the driver


def rank_model(spec: BackendSpec) -> Any:
    """The policy folder's model in fp32, as `training.model.load_policy` loads it on the driver: a
    vision-language one (a `vision_config`) through `AutoModelForImageTextToText`, its vision tower frozen
    unless `spec.freeze_vision` is false."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from tokenmill.engines.local.vision import is_vision_config

    vision = is_vision_config(AutoConfig.from_pretrained(spec.model_path))
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
        spec.model_path, dtype=torch.float32)
    if vision:
        from tokenmill.training.vision import freeze_vision_tower

        freeze_vision_tower(model, spec.freeze_vision)
    return model


def rank_lora(spec: BackendSpec, model: Any) -> Any:
    """`model` with `spec.lora`'s adapters, placed as on the driver: a vision-language policy's 'all-linear'
    adapters on its language model only, a trainable tower in full beside them."""
    from tokenmill.engines.local.vision import is_vision_config
    from tokenmill.training.lora import add_lora
    from tokenmill.training.vision import LANGUAGE_LORA_TARGETS, freeze_vision_tower

    lora, vision = spec.lora, is_vision_config(model.config)
    if vision and lora.target_modules == "all-linear":
        lora = lora.model_copy(update={"target_modules": LANGUAGE_LORA_TARGETS})
    model = add_lora(model, lora, task_type="CAUSAL_LM", field="model.lora")
    if vision and not spec.freeze_vision:
        freeze_vision_tower(model, False)
    return model


def rank_backend(spec: BackendSpec, model: Any, device: Any) -> Any:
    """One rank's `ShardedBackend` of `spec.trainer` over `model` (call inside the ranks' process group), with
    its own copy of the distillation teacher when the loss carries the full KL."""
    from tokenmill.training.spec import policy_backend

    teacher = None
    if spec.trainer.distill is not None:
        from transformers import AutoTokenizer

        from tokenmill.training.teacher import build_teacher, loss_teacher

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or spec.model_path)
        teacher = loss_teacher(build_teacher(spec.trainer.distill, model, tokenizer, device,
                                             autocast_dtype=spec.trainer.autocast_dtype), spec.trainer.distill)
    return policy_backend(spec.trainer, model, teacher=teacher, sharded=True, checkpoint_dir=spec.checkpoint_dir)


class TrainerRankActor:
    """The body of one rank actor (wrapped with `ray.remote` by `WorkerGroup`)."""

    def setup(self, spec: BackendSpec, init_method: str, rank: int, world: int) -> dict[str, Any]:
        import ray
        import torch

        from tokenmill.training.dist import init_distributed

        if ray.util.get_node_ip_address() == LOOPBACK:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback, like the cluster
        torch.set_num_threads(1)
        init_distributed(spec.pg_timeout_s, init_method=init_method, rank=rank, world_size=world)
        torch.manual_seed(spec.seed)
        from tokenmill.controller.ray.roles import rank_critic, rank_reference

        model = rank_model(spec)
        device = next(model.parameters()).device
        self.backend = self.reference = self.critic = None
        if "reference" in spec.roles:  # the initial weights, before the trainer shards `model` in place
            self.reference = rank_reference(spec, copy.deepcopy(model) if "policy" in spec.roles else model)
        if "critic" in spec.roles:
            self.critic = rank_critic(spec, device)
        if "policy" in spec.roles:
            if spec.lora is not None:  # the adapters start as the driver's: `set_trainable`
                model = rank_lora(spec, model)
            self.backend = rank_backend(spec, model, device)
        self.rank = rank
        return {"rank": rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def update(self, samples, algo, pad_id: int, max_tokens: int, seed: int) -> dict[str, float]:
        """`policy_update` on the global batch (the backend trains this rank's share)."""
        from tokenmill.training.update import policy_update

        return policy_update(samples, self.backend, algo, pad_id=pad_id, max_tokens=max_tokens,
                             rng=random.Random(seed))

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.backend, method)(*args)

    def reference_forward(self, batch) -> Any:
        """The reference logprobs of the global `batch` (each rank computes its rows; every rank returns all)."""
        return self.reference.forward(batch)

    def critic_call(self, method: str, *args: Any) -> Any:
        return getattr(self.critic, method)(*args)

    def weights(self) -> dict[str, Any] | None:
        """The trained parameters, full, on rank 0 (None on the others; a collective every rank consumes)."""
        full = {name: tensor.detach().clone() for name, tensor in self.backend.weights()}
        return full if self.rank == 0 else None

    def set_trainable(self, full: dict[str, Any]) -> None:
        """Set the trainable parameters named in `full` (whole tensors; each rank keeps its shard): a LoRA run's
        ranks start from the driver's adapters."""
        import torch
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for name, param in self.backend.model.named_parameters():
                if name in full:
                    value = full[name].to(param.dtype)
                    if isinstance(param, DTensor):
                        value = distribute_tensor(value, param.device_mesh, param.placements)
                    param.copy_(value)

    def gpu_ids(self) -> list[int]:
        """The GPUs Ray gave this rank (a colocated engine replica uses the same ones)."""
        import ray

        return [int(g) for g in ray.get_gpu_ids()]

    # the broadcast weight sync to engine replicas (controller.ray.weights, cluster.weight_sync: broadcast)
    def weight_port(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the weight group rank 0 hosts."""
        import ray

        from tokenmill.sync.broadcast import _free_port

        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def open_weight_sync(self, urls: list[str], host: str, port: int, token: str | None, timeout_s: float,
                         bucket_bytes: int, transport: str = "gloo", receivers: int = 1,
                         lora_scaling: float | None = None):
        from tokenmill.controller.ray.weights import RankWeightSender

        self.sender = getattr(self, "sender", None) or RankWeightSender()
        return self.sender.open(self.rank, self.backend, urls, host, port, token, timeout_s, bucket_bytes,
                                transport, receivers, lora_scaling)

    def push_weights(self, version: int) -> dict[str, Any]:
        from tokenmill.controller.ray.weights import RankWeightSender

        self.sender = getattr(self, "sender", None) or RankWeightSender()
        return self.sender.push(self.rank, self.backend, version)


@dataclass
class RankInfo:
    rank: int
    pid: int
    node_id: str


def reserve(ranks: int, cpus_per_rank: int, gpus_per_rank: int, strategy: str, timeout_s: float, *,
            role: str = "trainer") -> Any:
    """A ready placement group of `ranks` bundles laid out by `strategy`; ClusterError when the cluster cannot
    place it within `timeout_s`."""
    ray = import_ray()
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    pg = placement_group([dict(bundle) for _ in range(ranks)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ClusterError(f"cluster: {ranks} {role} bundles of {bundle} ({strategy}) were not placed within "
                           f"{timeout_s:g} s: the cluster lacks the resources") from None
    return pg


class WorkerGroup:
    """`ranks` trainer-rank actors on one placement group (`strategy` over the nodes, one bundle per rank)."""

    def __init__(self, cluster: RayCluster, spec: BackendSpec, ranks: int, *, cpus_per_rank: int = 1,
                 gpus_per_rank: int = 0, strategy: str = "PACK", start_timeout_s: float = 300.0,
                 pg: Any = None, role: str = "trainer") -> None:
        self.cluster, self.spec, self.world = cluster, spec, ranks
        self.gpus_per_rank, self.start_timeout_s = gpus_per_rank, start_timeout_s
        # `pg`: a placement group reserved beforehand (`reserve`), so that what starts later cannot take its room
        self.pg = pg if pg is not None else reserve(ranks, cpus_per_rank, gpus_per_rank, strategy, start_timeout_s,
                                                    role=role)
        self.actors: list[Any] = []
        self.ranks: list[RankInfo] = []
        self.generation = 0  # how many times the group was (re)built
        self._spawn()

    def _spawn(self) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(TrainerRankActor)
        self.actors = [cls.options(
            num_cpus=0, num_gpus=self.gpus_per_rank, max_restarts=0,  # the bundle holds the CPUs
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=r),
        ).remote() for r in range(self.world)]
        # the ranks meet through a file on the checkpoint filesystem, which every node sees anyway: no
        # rendezvous port (torch's TCPStore would listen on every interface, with no way to bind it)
        meet = Path(self.spec.checkpoint_dir) / ".rendezvous"
        meet.mkdir(parents=True, exist_ok=True)
        address = f"file://{meet.resolve()}/group-{self.generation + 1}-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        try:
            infos = self.cluster.get([a.setup.remote(self.spec, address, r, self.world)
                                      for r, a in enumerate(self.actors)],
                                     timeout_s=self.start_timeout_s, what=f"starting {self.world} trainer ranks")
        except Exception:
            self.kill()
            raise
        self.ranks = [RankInfo(**i) for i in infos]
        self.generation += 1
        log.info("trainer group %d up in %.1f s: %s", self.generation, time.monotonic() - t0,
                 ", ".join(f"rank {i.rank} pid {i.pid}" for i in self.ranks))

    def _gather(self, refs: list, what: str) -> list[Any]:
        """Every rank's answer; the first failure (a dead actor, an error, the time limit) raises at once."""
        ray = import_ray()
        pending = list(refs)
        deadline = time.monotonic() + self.cluster.call_timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RankFailure(f"{what}: no answer within {self.cluster.call_timeout_s:g} s "
                                  "(cluster.call_timeout_s)")
            try:
                ray.get(done[0])
            except ray.exceptions.RayError:
                raise RankFailure(f"{what}: {self._diagnose(refs)}") from None
        return ray.get(list(refs))

    def _diagnose(self, refs: list, settle_s: float = 2.0) -> str:
        """Which ranks failed and how, the dead ones first: a dead rank makes the survivors' collectives fail
        too, and either error may arrive first."""
        ray = import_ray()
        ray.wait(refs, num_returns=len(refs), timeout=settle_s)
        dead, failed = [], []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError as exc:
                dead.append(f"trainer rank {rank} died ({type(exc).__name__})")
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as exc:
                cause = getattr(exc, "cause", None) or exc
                first = (str(cause).strip().splitlines() or [""])[0]
                failed.append(f"trainer rank {rank} failed: {type(cause).__name__}: {clip(first, 300)}")
        return "; ".join(dead + failed) or "a trainer rank failed"

    def call(self, method: str, *args: Any) -> list[Any]:
        """`backend.<method>(*args)` on every rank (a collective); every rank's answer."""
        return self._gather([a.call.remote(method, *args) for a in self.actors], f"trainer {method}")

    def run(self, method: str, *args: Any, what: str) -> list[Any]:
        """`actor.<method>(*args)` on every rank, the arguments put in the object store once; every answer."""
        ray = import_ray()
        refs = [ray.put(a) for a in args]
        return self._gather([getattr(a, method).remote(*refs) for a in self.actors], what)

    def update(self, samples: Sequence, algo, *, pad_id: int, max_tokens: int, seed: int) -> dict[str, float]:
        """One `policy_update` on the global batch; the metrics (the same on every rank)."""
        ray = import_ray()
        ref = ray.put(list(samples))  # one copy in the object store, read by every rank
        return self._gather([a.update.remote(ref, algo, pad_id, max_tokens, seed) for a in self.actors],
                            "trainer update")[0]

    def set_trainable(self, full: dict[str, Any]) -> None:
        """Every rank's trainable parameters named in `full` set to those whole tensors (a LoRA run's adapters
        start as the driver's)."""
        ray = import_ray()
        ref = ray.put(full)
        self._gather([a.set_trainable.remote(ref) for a in self.actors], "trainer set_trainable")

    def kill(self) -> None:
        ray = import_ray()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []

    def rebuild(self) -> None:
        """A new group on the same placement group (the same nodes and devices)."""
        self.kill()
        self._spawn()

    def close(self) -> None:
        ray = import_ray()
        self.kill()
        ray.util.remove_placement_group(self.pg)


class RayBackend:
    """The `TrainBackend` verbs on the driver, each one run on every rank of `group` with the same global batch
    (the ranks split it); so `policy_update` and anything else written against the protocol runs unchanged
    in the driver. A failed rank raises `RankFailure` from the verb that saw it."""

    def __init__(self, group: WorkerGroup, mirror=None, *, broadcast: bool = False) -> None:
        self.group = group
        self.mirror = mirror  # a module in this process that every `weights()` call refreshes (the driver's copy)
        self.teacher_in_loss = group.spec.trainer.distill is not None  # each rank's loss adds the teacher's KL
        self.broadcast = broadcast  # weights() stays on the ranks: a RankBroadcastSync has rank 0 broadcast it
        self.sharing = None  # colocated engine replicas (an EngineFleet): they let go of memory during an update
        self._released = False

    def __getstate__(self) -> dict[str, Any]:
        """A copy sent to the ranks (inside a loss closure) leaves the driver's fleet behind (threads, locks)."""
        return {**self.__dict__, "sharing": None}

    def _take_devices(self) -> None:
        """Before the update's first verb: colocated replicas release their memory (once per update)."""
        if self.sharing is not None and not self._released:
            self.sharing.memory_turn(release=True)
            self._released = True

    def _give_back_devices(self) -> None:
        if self.sharing is not None and self._released:
            self.sharing.memory_turn(release=False)
            self._released = False

    def forward_backward(self, batch, loss_fn, entropy_coef: float = 0.0) -> dict[str, float]:
        self._take_devices()
        return self.group.call("forward_backward", batch, loss_fn, entropy_coef)[0]

    def forward(self, batch):
        self._take_devices()
        return self.group.call("forward", batch)[0]

    def optim_step(self) -> dict[str, float]:
        return self.group.call("optim_step")[0]

    def weights(self):
        """The trained parameters by name, gathered on rank 0 and sent here whole (held once in this process);
        in a broadcast run, a `RankWeights` that a `RankBroadcastSync` broadcasts from rank 0 instead."""
        self._give_back_devices()  # the update is done: colocated replicas take their memory back, then the weights
        if self.broadcast:
            from tokenmill.controller.ray.weights import RankWeights

            return RankWeights(self)
        return self.gathered_weights()

    def gathered_weights(self):
        group = self.group
        full = group._gather([a.weights.remote() for a in group.actors], "trainer weights")[0]
        if self.mirror is not None:
            import torch

            with torch.no_grad():
                for name, param in self.mirror.named_parameters():
                    param.copy_(full[name])
        yield from full.items()

    def state_dict(self) -> dict[str, Any]:
        return self.group.call("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group.call("load_state_dict", state)


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a space (never inside a word), "..." marking the cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 4].rsplit(" ", 1)[0] if " " in text[:limit - 4] else text[:limit - 4]
    return cut.rstrip(" ,;:") + " ..."


def train_with_restarts(group: WorkerGroup, steps: int, step_fn: Callable[[WorkerGroup, int], Any], *,
                        checkpoint_every: int, max_restarts: int) -> dict[str, Any]:
    """Run `step_fn(group, step)` for steps 0..steps-1, saving a sharded checkpoint every `checkpoint_every`
    steps; when a rank fails, rebuild the group, load the last checkpoint (or start over when there is none)
    and go on from there, at most `max_restarts` times. Returns what happened (restarts, their steps)."""
    saved: tuple[int, Any] | None = None
    restarts: list[dict[str, Any]] = []
    step = 0
    while step < steps:
        try:
            step_fn(group, step)
            step += 1
            if step % checkpoint_every == 0 or step == steps:
                saved = (step, group.call("state_dict")[0])
        except RankFailure as exc:
            if len(restarts) >= max_restarts:
                raise RankFailure(f"{exc}; gave up after {max_restarts} restart(s) (cluster.max_restarts)") from None
            t0 = time.monotonic()
            group.rebuild()
            resume = 0
            if saved is not None:
                resume, state = saved
                group.call("load_state_dict", state)
            restarts.append({"failed_at": step, "resumed_from": resume, "error": str(exc),
                             "seconds": round(time.monotonic() - t0, 2)})
            log.warning("trainer rank failed at step %d (%s); group rebuilt (restart %d of at most %d), resuming "
                        "from step %d", step, exc, len(restarts), max_restarts, resume)
            step = resume
    return {"steps": steps, "restarts": restarts}
