"""Memory estimate of a post-training run: per model, per device, with the breakdown, not only a total.

The formulas (derived in docs/memory-estimate.md; GB = 10^9 bytes, budgets are given in GiB):
- model states per parameter: trainable = weights + gradients + optimizer (+ fp32 master), frozen = weights;
  LoRA adapters `L·r·Σ(d_in+d_out)` train at full bytes, the base is frozen; FSDP/ZeRO divide by N;
- activations per token per layer `a_tok = b·(6h + 2·n_kv·d + 4I) + 4·n_h` (SDPA, SwiGLU; b = activation
  bytes); `L·T·a_tok` without recompute, `L·T·b·h + T·a_tok` with full checkpointing;
- logits `T·V·(bytes per logit)`: naive fp32 log-softmax 10 (bf16), gathered logit - logsumexp 6 (what
  tokenmill's `token_logprobs` keeps), chunked 2;
- engine KV cache `2·L·n_kv·d·b` per token for every sequence in flight (a GRPO group multiplies them).
A device's peak is its persistent bytes plus the largest phase (train, score, rollout): the phases do not
overlap in time. `MemoryPlan` -> `estimate()` / `solve_budget()` is the Python API; `estimate.config` builds
the plan from a tokenmill config dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from tokenmill.estimate.model_specs import LINEARS, ModelShape

GB = 10**9
GIB = 2**30
ADAM_8BIT_BYTES = 2  # two 8-bit moments per parameter
FROZEN_QUANT_BYTES = {"none": None, "int8": 1.0, "nf4": 0.5}  # QLoRA-style storage of a frozen LoRA base
FSDP_UNITS_IN_FLIGHT = 2  # the all-gathered unit being computed plus the prefetched next one


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter (weights, gradients, fp32 master copy, AdamW moments) and per activation."""

    weights: int
    grads: int
    master: int
    adam: int
    activations: int


PRECISIONS = {
    "fp32": Precision(4, 4, 0, 8, 4),
    "amp": Precision(4, 4, 0, 8, 2),  # tokenmill's way: fp32 weights, bf16 autocast
    "bf16_mixed": Precision(2, 2, 4, 8, 2),  # bf16 weights + fp32 master (DeepSpeed / Megatron)
    "bf16": Precision(2, 2, 0, 4, 2),  # pure bf16, moments in bf16
}


@dataclass(frozen=True)
class MemoryPlan:
    """Everything the estimate depends on: model, algorithm, numerics, parallelism, workload, budget."""

    policy: ModelShape
    mode: Literal["rl", "preference", "reward_model", "sft"] = "rl"
    algorithm: str = "grpo"
    reference: bool = False  # a frozen reference model (KL penalty, DPO / IPO)
    critic: ModelShape | None = None  # PPO's value model
    critic_lora_rank: int = 0
    reward_models: tuple[ModelShape, ...] = ()
    precision: Literal["fp32", "amp", "bf16_mixed", "bf16"] = "bf16_mixed"
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    gradient_checkpointing: bool = False
    logprobs: Literal["naive", "gather", "chunked"] = "chunked"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LINEARS
    freeze_vision: bool = True  # a vision-language policy's vision tower: weights only, no gradients or optimizer
    frozen_quant: Literal["none", "int8", "nf4"] = "none"
    sharding: Literal["none", "zero1", "zero2", "fsdp"] = "none"
    num_devices: int = 1
    device: Literal["cuda", "cpu"] = "cuda"
    device_memory_bytes: int | None = None
    margin: float = 0.1  # allocator fragmentation
    micro_batch_tokens: int = 4096  # T: tokens in one forward/backward on one device
    prompt_tokens: int = 0
    completion_tokens: int = 1024
    sequences_in_flight: int = 0  # generated at once across all devices (prompts x group size)
    global_sequences: int = 1  # sequences per optimizer step
    engine: Literal["none", "hf", "vllm"] = "none"
    engine_copy: bool = False  # hf engine of a thread / worker placement: its own copy of the policy's weights
    engine_memory_utilization: float = 0.5
    engine_sleep: bool = False
    optimizer_offload: bool = False  # training.optimizer_offload: AdamW's state (and its fp32 copy) on the host

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch: at least one whole sequence (a sequence is never split)."""
        return max(self.micro_batch_tokens, self.seq_len)

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]


# --- the formulas -------------------------------------------------------------------------------------------


def activation_bytes_per_token(shape: ModelShape, act_bytes: int = 2, lse_bytes: int = 4) -> int:
    """a_tok: bytes one layer keeps for backward per token (inputs of the norms and linears, q/k/v and the
    output of attention, SDPA's fp32 log-sum-exp per head, the SwiGLU gate, up, act(gate) and product)."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    return act_bytes * (6 * h + 2 * kv + 4 * shape.intermediate_size) + lse_bytes * shape.num_heads


def activation_bytes(shape: ModelShape, tokens: int, act_bytes: int = 2, checkpointing: bool = False) -> int:
    """All layers; with full checkpointing only each layer's input stays, plus one layer being recomputed."""
    a_tok = activation_bytes_per_token(shape, act_bytes)
    if checkpointing:
        return shape.num_layers * tokens * act_bytes * shape.hidden_size + tokens * a_tok
    return shape.num_layers * tokens * a_tok


def logit_bytes_per_token(vocab: int, mode: str, act_bytes: int = 2) -> int:
    """naive: logits + an fp32 copy + the fp32 log-softmax; gather: logits + the fp32 copy logsumexp keeps;
    chunked: the logits only. A no-grad pass holds the same tensors for a moment."""
    fp32_copy = 0 if act_bytes == 4 else 4
    per_logit = {"naive": act_bytes + fp32_copy + 4, "gather": act_bytes + fp32_copy, "chunked": act_bytes}[mode]
    return vocab * per_logit


def kv_bytes_per_token(shape: ModelShape, kv_bytes: int = 2) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_bytes


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] = LINEARS) -> int:
    """Adapter parameters `L·r·Σ(d_in + d_out)` over the adapted linear layers."""
    dims = shape.linear_dims()
    return shape.num_layers * rank * sum(sum(dims[name]) for name in targets if name in dims)


# --- per model ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    name: str  # actor, critic, reference, reward_model, engine
    shape: ModelShape
    trainable: bool
    head: Literal["lm", "value", "reward"] = "lm"
    lora_rank: int = 0
    shares_actor_weights: bool = False  # LoRA reference (adapters off), in-process engine


@dataclass(frozen=True)
class ModelMemory:
    role: str
    device: str
    trainable: bool
    params: int
    trainable_params: int
    bytes: dict[str, int]  # component -> bytes on each device of `device`
    phases: dict[str, str]  # component -> persistent | train | score | rollout


def active_roles(plan: MemoryPlan) -> list[Role]:
    """Which models exist for the algorithm: the policy always; a frozen reference for a KL penalty or DPO / IPO
    (free for a LoRA policy: its base with the adapters off is the reference); PPO's critic; reward models."""
    actor = Role("actor", plan.policy, True, lora_rank=plan.lora_rank)
    if plan.mode == "sft":
        return [actor]
    if plan.mode == "reward_model":
        return [Role("reward_model", plan.policy, True, head="reward", lora_rank=plan.lora_rank)]
    roles = [actor]
    if plan.reference:
        roles.append(Role("reference", plan.policy, False, shares_actor_weights=plan.lora_rank > 0))
    if plan.mode == "preference":
        return roles
    if plan.critic is not None:
        roles.append(Role("critic", plan.critic, True, head="value", lora_rank=plan.critic_lora_rank))
    roles += [Role("reward_model", shape, False, head="reward") for shape in plan.reward_models]
    if plan.engine != "none":
        roles.append(Role("engine", plan.policy, False, shares_actor_weights=plan.engine == "hf"))
    return roles


def _params(role: Role) -> int:
    if role.head == "lm":
        return role.shape.num_params
    return role.shape.scalar_head_params(bias=role.head == "value")


def _sharded(plan: MemoryPlan, weights: float, grads: float, optim: float) -> tuple[float, float, float]:
    n, kind = plan.num_devices, plan.sharding if plan.num_devices > 1 else "none"
    if kind == "fsdp":
        return weights / n, grads / n, optim / n
    if kind == "zero2":
        return weights, grads / n, optim / n
    if kind == "zero1":
        return weights, grads, optim / n
    return weights, grads, optim


def _engine_memory(plan: MemoryPlan, role: Role) -> tuple[dict[str, int], dict[str, str]]:
    kv_bytes = kv_bytes_per_token(role.shape, plan.prec.activations)
    kv = math.ceil(plan.sequences_in_flight * plan.seq_len * kv_bytes / plan.num_devices)
    if plan.engine == "hf" and plan.engine_copy:  # a copy of the weights, held for the whole run
        return {"weights": plan.prec.weights * _params(role), "kv_cache": kv}, {"weights": "persistent",
                                                                              "kv_cache": "rollout"}
    if plan.engine == "hf":  # in-process: the actor's own weights, a KV cache only while generating
        return {"kv_cache": kv}, {"kv_cache": "rollout"}
    weights = math.ceil(2 * _params(role) / plan.num_devices)  # vLLM's bf16 copy, tensor-parallel over N
    if plan.device_memory_bytes is not None:  # vLLM reserves its share up front and fills it with KV blocks
        kv = max(kv, int(plan.engine_memory_utilization * plan.device_memory_bytes) - weights)
    phase = "rollout" if plan.engine_sleep else "persistent"  # a sleeping engine frees both while training
    return {"weights": weights, "kv_cache": kv}, {"weights": phase, "kv_cache": phase}


def model_memory(plan: MemoryPlan, role: Role) -> ModelMemory:
    """The byte breakdown of one model on each device of the training group."""
    kind = "cpu" if plan.device == "cpu" else "cuda"
    device = f"{kind}:0" if plan.num_devices == 1 else f"each of {plan.num_devices} x {kind}"
    params = _params(role)
    if role.name == "engine":
        parts, phases = _engine_memory(plan, role)
        return ModelMemory(role.name, device, False, params, 0, parts, phases)
    prec, shape, tokens = plan.prec, role.shape, plan.tokens
    trainable, frozen = (0, params) if not role.trainable else (params, 0)
    if role.trainable and plan.freeze_vision:  # the vision tower is held, not trained
        trainable, frozen = params - shape.vision_params, shape.vision_params
    if role.trainable and role.lora_rank > 0:  # a LoRA critic / reward model also trains its scalar head
        head = 0 if role.head == "lm" else shape.hidden_size + int(role.head == "value")
        trainable, frozen = lora_params(shape, role.lora_rank, plan.lora_targets) + head, params - head
    frozen_bytes = FROZEN_QUANT_BYTES[plan.frozen_quant] if role.lora_rank > 0 else None
    stored = trainable * prec.weights + frozen * (frozen_bytes or prec.weights)
    optim = trainable * (prec.master + (ADAM_8BIT_BYTES if plan.optimizer == "adamw_8bit" else prec.adam))
    weights, grads, optim = _sharded(plan, 0 if role.shares_actor_weights else stored, trainable * prec.grads, optim)
    parts = {"weights": math.ceil(weights)}
    if role.trainable:
        offloaded = plan.optimizer_offload and role.name == "actor"  # the policy's optimiser steps on the host
        parts |= {"gradients": math.ceil(grads), "optimizer": 0 if offloaded else math.ceil(optim)}
    if plan.sharding == "fsdp" and plan.num_devices > 1 and not role.shares_actor_weights:
        unit = max(shape.layer_params, shape.embedding_params, shape.lm_head_params)
        parts["fsdp_buffers"] = FSDP_UNITS_IN_FLIGHT * unit * prec.weights
    if role.trainable:
        acts = activation_bytes(shape, tokens, prec.activations, plan.gradient_checkpointing)
        adapted = sum(name in shape.linear_dims() for name in plan.lora_targets) if role.lora_rank else 0
        lora_layers = 1 if plan.gradient_checkpointing else shape.num_layers  # the r-wide LoRA intermediates
        parts["activations"] = acts + lora_layers * tokens * prec.activations * role.lora_rank * adapted
        if role.head == "lm":
            parts["logits"] = tokens * logit_bytes_per_token(shape.vocab_size, plan.logprobs, prec.activations)
    if role.head == "lm" and (role.name == "reference" or (role.name == "actor" and plan.mode == "rl")):
        # reference log-probs, and the old policy's before the update: no-grad passes over the batch
        parts["logits_nograd"] = tokens * logit_bytes_per_token(shape.vocab_size, plan.logprobs, prec.activations)
    phases = {k: {"activations": "train", "logits": "train", "logits_nograd": "score"}.get(k, "persistent")
              for k in parts}
    return ModelMemory(role.name, device, role.trainable, params, trainable, parts, phases)


# --- per device ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    persistent: int
    phases: dict[str, int]  # train: the largest trainable model's (they train one after another)
    overhead: int
    margin: int
    total: int
    budget: int | None

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget


def overhead_bytes(plan: MemoryPlan) -> int:
    """CUDA context ~1 GiB (+ NCCL ~0.5 GiB on several GPUs); on CPU ~1.5 GB of Python, tokenizer, data."""
    if plan.device == "cpu":
        return int(1.5 * GB)
    return GIB + (GIB // 2 if plan.num_devices > 1 else 0)


def by_phase(m: ModelMemory) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in m.bytes.items():
        out[m.phases[key]] = out.get(m.phases[key], 0) + value
    return out


def device_memory(plan: MemoryPlan, models: list[ModelMemory]) -> DeviceMemory:
    persistent, phases = 0, {"train": 0, "score": 0, "rollout": 0}
    for m in models:
        parts = by_phase(m)
        persistent += parts.pop("persistent", 0)
        for phase, value in parts.items():  # models train / score one after another; engines add up
            phases[phase] = phases[phase] + value if phase == "rollout" else max(phases[phase], value)
    subtotal = persistent + max(phases.values()) + overhead_bytes(plan)
    margin = math.ceil(subtotal * plan.margin / (1 - plan.margin))
    return DeviceMemory(models[0].device, persistent, phases, overhead_bytes(plan), margin, subtotal + margin,
                        plan.device_memory_bytes)


@dataclass(frozen=True)
class MemoryEstimate:
    plan: MemoryPlan
    models: list[ModelMemory]
    device: DeviceMemory
    warnings: list[str] = field(default_factory=list)


def estimate(plan: MemoryPlan) -> MemoryEstimate:
    """Per-model breakdown and the per-device total of `plan` (every device of the group looks alike)."""
    models = [model_memory(plan, role) for role in active_roles(plan)]
    dev = device_memory(plan, models)
    warnings = []
    if dev.fits is False:
        warnings.append(f"device '{dev.name}': needs {dev.total / GIB:.2f} GiB at its peak ({dev.peak_phase} "
                        f"phase), over the {dev.budget / GIB:.1f} GiB budget by {(dev.total - dev.budget) / GIB:.2f} GiB")
    if plan.micro_batch_tokens < plan.seq_len:
        warnings.append(f"micro-batch of {plan.micro_batch_tokens} tokens holds no whole sequence of "
                        f"{plan.seq_len}: each sequence runs alone")
    if plan.engine == "vllm" and plan.device_memory_bytes is None:
        warnings.append("engine vllm: without a device memory budget its up-front reservation is unknown; "
                        "counted only the KV cache the sequences in flight need")
    if plan.device == "cpu" and plan.policy.num_params > 1.5e9:
        warnings.append(f"{plan.policy.name}: {plan.policy.num_params / 1e9:.1f}B parameters on CPU will be "
                        "very slow; tokenmill on CPU suits models up to ~0.5B")
    return MemoryEstimate(plan, models, dev, warnings)


# --- budget solver, proposals, backend advice ---------------------------------------------------------------


@dataclass(frozen=True)
class Proposal:
    action: str
    setting: str  # the config change that does it
    saving_bytes: int  # on the busiest device, at a one-sequence micro-batch, after the proposals before it
    fits_after: bool


@dataclass(frozen=True)
class BudgetSolution:
    """`T_max = ⌊(M·(1−margin) − fixed) / c⌋` -> micro-batch (sequences) and gradient accumulation."""

    budget_bytes: int
    fixed_bytes: int  # persistent model states + overhead
    bytes_per_token: int  # c: activations + logits of the largest trainable model, per token
    max_tokens: int  # T_max (0 when not even the fixed part fits)
    micro_batch: int  # sequences per micro-batch
    grad_accum: int  # micro-batches per optimizer step on each device (0 when it does not fit)
    rollout_fits: bool
    proposals: list[Proposal]

    @property
    def fits(self) -> bool:
        return self.micro_batch >= 1 and self.rollout_fits


def bytes_per_token(plan: MemoryPlan) -> int:
    """c, measured with the formulas on a one-token micro-batch (every token-dependent term is linear)."""
    probe = replace(plan, micro_batch_tokens=1, prompt_tokens=0, completion_tokens=1)
    cost = 0
    for m in (model_memory(probe, role) for role in active_roles(probe)):
        cost = max(cost, sum(v for k, v in m.bytes.items() if m.phases[k] in ("train", "score")))
    return cost


def _one_sequence_total(plan: MemoryPlan) -> DeviceMemory:
    return estimate(replace(plan, micro_batch_tokens=plan.seq_len)).device


def _more_devices(plan: MemoryPlan) -> tuple[str, str, MemoryPlan] | None:
    more = [n for n in (2, 4, 8, 16, 32, 64) if n > plan.num_devices]
    if not more:
        return None
    n = next((n for n in more if _one_sequence_total(replace(plan, num_devices=n, sharding="fsdp")).fits), more[-1])
    return f"{n} GPUs with FSDP2 / ZeRO-3", f"num_devices: {n}, estimate.sharding: fsdp", \
        replace(plan, num_devices=n, sharding="fsdp")


def _shorter(plan: MemoryPlan, rl: bool) -> tuple[str, str, MemoryPlan] | None:
    if plan.completion_tokens < 2:
        return None
    p = replace(plan, completion_tokens=plan.completion_tokens // 2)
    setting = f"generation.max_tokens: {p.completion_tokens}" if rl else f"estimate.seq_len: {p.seq_len}"
    return f"halve the completions to {p.completion_tokens} tokens", setting, p


def propose(plan: MemoryPlan) -> list[Proposal]:
    """Cheapest first: checkpointing -> chunked log-probs -> LoRA -> engine sleep -> optimizer offload -> more
    GPUs -> shorter completions. Each is applied on top of the earlier ones and listed with what it saves on the
    busiest device at a one-sequence micro-batch; one that saves nothing is left out; the list ends at the first
    that fits."""
    steps = [
        lambda p: None if p.gradient_checkpointing else (
            "gradient checkpointing", "estimate.gradient_checkpointing: true", replace(p, gradient_checkpointing=True)),
        lambda p: None if p.logprobs == "chunked" else (
            "chunked log-probs", "estimate.logprobs: chunked", replace(p, logprobs="chunked")),
        lambda p: None if p.lora_rank else (
            "LoRA rank 16 on every linear layer", "model.lora.rank: 16", replace(p, lora_rank=16, lora_targets=LINEARS)),
        lambda p: None if p.engine != "vllm" or p.engine_sleep else (
            "engine sleeps while training (weights offloaded, KV freed)", "estimate.engine_sleep: true",
            replace(p, engine_sleep=True)),
        lambda p: None if p.optimizer_offload or p.num_devices > 1 else (
            "optimizer state in CPU memory", "training.optimizer_offload: true", replace(p, optimizer_offload=True)),
        _more_devices,
        lambda p: _shorter(p, plan.mode == "rl"),
    ]
    proposals, current, before = [], plan, _one_sequence_total(plan).total
    for step in steps:
        found = step(current)
        if found is None:
            continue
        action, setting, changed = found
        after = _one_sequence_total(changed)
        if after.total >= before:
            continue
        proposals.append(Proposal(action, setting, before - after.total, bool(after.fits)))
        current, before = changed, after.total
        if after.fits:
            break
    return proposals


def solve_budget(plan: MemoryPlan) -> BudgetSolution | None:
    """The largest micro-batch under `plan.device_memory_bytes`; when not even one sequence fits, the ordered
    proposals with what each saves. None without a budget."""
    if plan.device_memory_bytes is None:
        return None
    dev = estimate(plan).device
    usable = plan.device_memory_bytes * (1 - plan.margin)
    fixed = dev.persistent + dev.overhead
    cost = bytes_per_token(plan)
    t_max = max(0, math.floor((usable - fixed) / cost))
    micro = t_max // plan.seq_len
    accum = math.ceil(plan.global_sequences / (micro * plan.num_devices)) if micro else 0
    rollout_fits = fixed + dev.phases["rollout"] <= usable
    proposals = [] if micro >= 1 and rollout_fits else propose(plan)
    return BudgetSolution(plan.device_memory_bytes, fixed, cost, t_max, micro, accum, rollout_fits, proposals)


def _fits(plan: MemoryPlan) -> bool:
    return bool(_one_sequence_total(plan).fits)


def recommend_backend(plan: MemoryPlan) -> dict[str, Any]:
    """CPU up to ~0.5B; one GPU if it fits, else LoRA / QLoRA; FSDP2 over 2-64 GPUs up to ~70B; beyond, or
    when 64 do not suffice, Megatron-class parallelism. Without a budget, 80 GiB devices are assumed."""
    params = plan.policy.num_params
    budget = plan.device_memory_bytes or 80 * GIB
    base = replace(plan, device="cuda", device_memory_bytes=budget, num_devices=1, sharding="none")
    gib = f"{budget / GIB:.0f} GiB"
    if plan.device == "cpu":
        ok = params <= 0.6e9
        return {"backend": "cpu" if ok else "gpu", "num_devices": 1,
                "reason": f"{params / 1e9:.2f}B parameters: " + ("a single CPU process works" if ok else
                          "too large to train on CPU in useful time; use GPUs")}
    if params > 100e9:
        return {"backend": "megatron", "num_devices": None,
                "reason": f"{params / 1e9:.0f}B parameters: tensor / pipeline parallelism (Megatron-class)"}
    if _fits(base):
        return {"backend": "single_gpu", "num_devices": 1,
                "reason": f"fits one {gib} device once the micro-batch is sized by the budget solver (the "
                          "budget panel's setting)"}
    full_fsdp = next((n for n in (2, 4, 8, 16, 32, 64) if _fits(replace(base, num_devices=n, sharding="fsdp"))), None)
    if plan.lora_rank == 0:
        for label, changed in (("LoRA", replace(base, lora_rank=16)),
                               ("QLoRA (NF4 base)", replace(base, lora_rank=16, frozen_quant="nf4"))):
            if _fits(changed):
                other = f"; full fine-tuning fits {full_fsdp} devices with FSDP2" if full_fsdp else ""
                return {"backend": "single_gpu_" + label.split()[0].lower(), "num_devices": 1,
                        "reason": f"full fine-tuning does not fit one {gib} device; {label} rank 16 does{other}"}
    if full_fsdp:
        return {"backend": "fsdp2", "num_devices": full_fsdp,
                "reason": f"model states sharded with FSDP2 / ZeRO-3 fit {full_fsdp} x {gib} devices"}
    return {"backend": "megatron", "num_devices": None,
            "reason": f"64 x {gib} devices with FSDP2 do not fit: tensor / pipeline parallelism needed"}

