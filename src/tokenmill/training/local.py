"""Single-process torch backend: micro-batches, gradient accumulation, AdamW, warm-up + decay, clipping."""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from tokenmill.training.base import BatchLoss
from tokenmill.training.batch import Batch
from tokenmill.training.logprobs import DEFAULT_CHUNK_MIB, sequence_token_stats, token_entropy, token_logprobs
from tokenmill.training.offload import offloaded
from tokenmill.training.packing import micro_packs, packed_token_stats, prompt_segments, sequence_segments
from tokenmill.training.router_replay import replaying, trainer_routes

# token_logprobs / token_entropy (the full-logits path) are imported from here too
__all__ = ["LocalBackend", "ReferenceModel", "batch_logprobs", "micro_token_stats", "packing_segments",
           "token_entropy", "token_logprobs"]


def packing_segments(batch: Batch, *, share_prompts: bool, pack_sequences: bool):
    """How `micro_token_stats` packs `batch`: whole sequences side by side (`pack_sequences`), groups sharing
    a prompt (when that saves rows), or None for length-bucketed padded rows."""
    if pack_sequences:
        return sequence_segments(batch)
    if share_prompts and batch.prompt_lens_B is not None:
        segments = prompt_segments(batch)
        return segments if len(segments) < batch.size else None
    return None

def micro_token_stats(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float,
    token_budget: int,
    share_prompts: bool = True,
    pack_sequences: bool = False,
    entropy: bool = False,
    entropy_grad: bool = False,
    autocast_dtype: torch.dtype | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_MIB << 20,
    teacher: Any = None,
    replay: bool = False,
    batch_invariant: bool = False,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Per micro-batch: (its rows in `batch`, the micro-batch on the model's device, its token logprobs, its
    token entropies or None). Groups sharing a prompt are packed (`training.packing`; only completion tokens
    get values there); with `pack_sequences` whole sequences are packed side by side (SFT); otherwise
    length-bucketed padded rows. Gradients flow unless the caller disables them. The LM head runs on chunks
    of at most `chunk_bytes` of fp32 logits (`training.logprobs`; 0 = the model's full logits). With a
    `teacher` each tuple has a fifth tensor: the reverse KL to it per token (`logprobs.reverse_kl`): a module
    (its whole distribution), or an object whose `top(input_ids_B_T, lengths_B)` gives its top-k ids and
    logprobs `[B, T, K]` (`training.teacher.TopKTeacher`: the bucketed KL, on padded rows, never packed).
    With `replay` and recorded routes (`batch.routes_B_T_R`), a mixture-of-experts model routes each token as
    recorded (`training.router_replay`; padded rows, never packed), until the caller asks for the next tuple
    (so a backward through a recomputed forward routes the same). `batch_invariant` (`training.deterministic`):
    every sample is a micro-batch of its own, a row of exactly its tokens, so its numbers never depend on the
    batch it came in, the token budget or the packing (`logprobs.row_logprobs` computes the same)."""
    if batch.images_B is not None:  # a vision-language policy's batch: packed with its pictures (`training.vision`)
        from tokenmill.training.vision import vision_micro_stats

        yield from vision_micro_stats(model, batch, temperature=temperature, token_budget=token_budget,
                                      chunk_bytes=chunk_bytes, share_prompts=share_prompts,
                                      pack_sequences=pack_sequences, entropy=entropy, entropy_grad=entropy_grad,
                                      autocast_dtype=autocast_dtype)
        return
    device = next(model.parameters()).device
    top_k = teacher is not None and not isinstance(teacher, torch.nn.Module)
    routed = replay and batch.routes_B_T_R is not None
    segments = None if top_k or routed or batch_invariant else packing_segments(
        batch, share_prompts=share_prompts, pack_sequences=pack_sequences)
    if segments is not None:
        for micro, packed in micro_packs(batch, token_budget, segments):
            micro = micro.to(device)
            stats = packed_token_stats(
                model, packed, tuple(micro.input_ids_B_T.shape), temperature=temperature, entropy=entropy,
                entropy_grad=entropy_grad, autocast_dtype=autocast_dtype, chunk_bytes=chunk_bytes, teacher=teacher,
            )
            yield packed.batch_rows, micro, *stats
        return
    start = 0
    one_each = (batch.slice(i, i + 1) for i in range(batch.size))  # batch_invariant: a row of its own tokens
    for micro in one_each if batch_invariant else batch.micro_batches(token_budget):
        micro = micro.to(device)
        taught = tuple(t.to(device) for t in teacher.top(micro.input_ids_B_T, micro.lengths_B)) if top_k else teacher
        rows = torch.arange(start, start + micro.size)
        start += micro.size
        with replaying(model, micro.routes_B_T_R if routed else None):
            stats = sequence_token_stats(
                model, micro.input_ids_B_T, lengths_B=micro.lengths_B, temperature=temperature,
                chunk_bytes=chunk_bytes, entropy=entropy, entropy_grad=entropy_grad, autocast_dtype=autocast_dtype,
                teacher=taught,
            )
            yield rows, micro, *stats


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float,
    token_budget: int,
    share_prompts: bool = True,
    autocast_dtype: torch.dtype | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_MIB << 20,
    replay: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Logprobs of the tokens of `batch` under `model`, micro-batched, on the CPU, aligned with the batch.
    With shared prompts (and `share_prompts`) the groups are packed and only completion tokens get a value
    (prompt positions stay 0; no loss weight falls there). `replay`: route as recorded (`micro_token_stats`)."""
    out = torch.zeros_like(batch.old_logprobs_B_T)
    for rows, _, lp, _ in micro_token_stats(model, batch, temperature=temperature, token_budget=token_budget,
                                            share_prompts=share_prompts, autocast_dtype=autocast_dtype,
                                            chunk_bytes=chunk_bytes, replay=replay, batch_invariant=batch_invariant):
        out[rows, : lp.shape[1]] = lp.float().cpu()
    return out


class ReferenceModel:
    """The initial policy, used only for the KL term (built only when kl_coef > 0): a frozen copy, or, for a
    LoRA policy (`adapters_off=True`), the trainer's own module with its adapters disabled: the same
    numbers as the base, without a second copy of the weights."""

    def __init__(
        self, model: torch.nn.Module, *, temperature: float, token_budget: int, share_prompts: bool = True,
        adapters_off: bool = False, logits_chunk_mib: float = DEFAULT_CHUNK_MIB,
    ) -> None:
        self.adapters_off = adapters_off
        self.chunk_bytes = int(logits_chunk_mib * 2**20)
        self.model = model if adapters_off else model.eval().requires_grad_(False)
        self.temperature = temperature
        self.token_budget = token_budget
        self.share_prompts = share_prompts

    def forward(self, batch: Batch) -> torch.Tensor:
        if not self.adapters_off:
            return self._logprobs(batch)
        was_training = self.model.training
        self.model.eval()  # like the frozen copy: no dropout
        try:
            with torch.no_grad(), self.model.disable_adapter():
                return self._logprobs(batch)
        finally:
            self.model.train(was_training)

    def _logprobs(self, batch: Batch) -> torch.Tensor:
        return batch_logprobs(self.model, batch, temperature=self.temperature, token_budget=self.token_budget,
                              share_prompts=self.share_prompts, chunk_bytes=self.chunk_bytes)


def lr_lambda(schedule: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _adamw(params: list[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW with the fused kernel where the device and dtype support it (~3x faster than foreach on a
    small CPU model), the foreach one otherwise."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


class LocalBackend:
    """Trains one module in this process. `temperature` matches the sampler's (logits are divided by it). The
    LM head runs on chunks of `logits_chunk_mib` MiB of fp32 logits (`training.logprobs`; 0 = full logits).

    `distill_teacher` (on-policy distillation's `loss: full`; `training.teacher.loss_teacher`): a frozen module
    with the policy's vocabulary, or a `training.teacher.TopKTeacher`; every micro-batch's loss then adds
    `distill_coef` x the weighted reverse KL from the policy to it at each trained position
    (`logprobs.reverse_kl`; bucketed for top-k), reported as `distill/reverse_kl`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        total_steps: int,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        max_grad_norm: float = 1.0,
        micro_batch_tokens: int = 8192,
        temperature: float = 1.0,
        track_entropy: bool = True,
        autocast_dtype: torch.dtype | None = None,
        share_prompts: bool = True,
        pack_sequences: bool = False,
        logits_chunk_mib: float = DEFAULT_CHUNK_MIB,
        distill_teacher: Any = None,
        distill_coef: float = 1.0,
        router_replay: str = "off",
        activation_checkpointing: bool = False,
        kernels: str = "none",
        optimizer_offload: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        from tokenmill.training.kernels import apply_trainer_kernels

        self.model = model
        self.router_replay = router_replay  # off | r2 | r3 (`training.router_replay`)
        self.activation_checkpointing, self.kernels = activation_checkpointing, kernels
        apply_trainer_kernels(model, activation_checkpointing=activation_checkpointing, kernels=kernels)
        self.distill_teacher, self.distill_coef = distill_teacher, distill_coef
        self.chunk_bytes = int(logits_chunk_mib * 2**20)  # 0: the model's full logits
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        adamw = partial(_adamw, lr=learning_rate, betas=betas, weight_decay=weight_decay)
        # training.optimizer_offload: AdamW steps on CPU copies (training.offload), its moments in host memory
        self.host = None
        if optimizer_offload:
            self.optimizer, self.host = offloaded(self.params, adamw)
        else:
            self.optimizer = adamw(self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(lr_schedule, warmup_steps, total_steps)
        )
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.track_entropy = track_entropy
        self.autocast_dtype = autocast_dtype
        self.share_prompts = share_prompts
        self.pack_sequences = pack_sequences
        self.batch_invariant = batch_invariant  # one sample per row (`micro_token_stats`; training.deterministic)

    @property
    def teacher_in_loss(self) -> bool:
        """Whether every micro-batch's loss adds the reverse KL to a teacher (then no sample is without gradient)."""
        return self.distill_teacher is not None

    def forward_backward(self, batch: Batch, loss_fn: BatchLoss, entropy_coef: float = 0.0) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` (minus `entropy_coef` x the weighted token entropy: an entropy
        bonus) over the micro-batches; return the metrics summed over them."""
        self.model.train()
        totals: dict[str, float] = {}
        bonus = entropy_coef > 0
        stats = micro_token_stats(
            self.model, batch, temperature=self.temperature, token_budget=self.micro_batch_tokens,
            share_prompts=self.share_prompts, pack_sequences=self.pack_sequences,
            entropy=self.track_entropy or bonus, entropy_grad=bonus,
            autocast_dtype=self.autocast_dtype, chunk_bytes=self.chunk_bytes, teacher=self.distill_teacher,
            replay=self.router_replay != "off", batch_invariant=self.batch_invariant,
        )
        for _, micro, logprobs_B_T, ent, *kl in stats:
            loss, metrics = loss_fn(logprobs_B_T, micro)
            if ent is not None:
                weighted = (ent * micro.weights_B_T).sum()
                metrics["entropy"] = weighted.detach()
                if bonus:
                    loss = loss - entropy_coef * weighted
            if kl:  # on-policy distillation's full reverse KL to the teacher, per trained token
                weighted = (kl[0] * micro.weights_B_T).sum()
                metrics["distill/reverse_kl"] = weighted.detach()
                loss = loss + self.distill_coef * weighted
            loss.backward()
            metrics["loss"] = loss.detach()
            metrics["weight"] = micro.weights_B_T.sum()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return totals

    def forward(self, batch: Batch) -> torch.Tensor:
        return batch_logprobs(
            self.model, batch, temperature=self.temperature, token_budget=self.micro_batch_tokens,
            share_prompts=self.share_prompts, autocast_dtype=self.autocast_dtype, chunk_bytes=self.chunk_bytes,
            replay=self.router_replay != "off", batch_invariant=self.batch_invariant,
        )

    @torch.no_grad()
    def record_routes(self, batch: Batch) -> torch.Tensor:
        """`[B, T, R]`: the expert indices the model routes each token of `batch` to now (a no-grad pass in
        eval mode, micro-batched; router replay r2 records them before the update). `batch_invariant`: each
        row on its own (a budget of 0), the routes the engine's scoring pass picks (`logprobs.rescore_groups`)."""
        was_training = self.model.training
        self.model.eval()
        budget = 0 if self.batch_invariant else self.micro_batch_tokens
        try:
            return trainer_routes(self.model, batch, budget, self.autocast_dtype)
        finally:
            self.model.train(was_training)

    def optim_step(self) -> dict[str, float]:
        """Apply the accumulated gradients (clipped to `max_grad_norm`); report their norm and the learning rate
        applied. A non-finite gradient norm (NaN or inf: a NaN loss, advantage or input) is never applied: the
        gradients are dropped, the weights and AdamW's moments stay as they were, and the metrics say
        `skipped_nonfinite: 1`. The learning-rate schedule still advances, so it stays aligned with the run's
        steps whether or not some were skipped."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True))
        lr = self.optimizer.param_groups[0]["lr"]  # what this step applies (set by the schedule, or by hand)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if self.host is not None:
                self.host.to_host()
            self.optimizer.step()
            if self.host is not None:
                self.host.to_device()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.host is not None:
            self.host.zero_grad()
        return {"grad_norm": grad_norm, "lr": lr} | ({"skipped_nonfinite": 1.0} if skipped else {})

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync must send: the parameters that train (with LoRA, only the adapters; frozen
        weights never change, so an engine that has the base model needs nothing else)."""
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                yield name, p

    def state_dict(self) -> dict[str, Any]:
        """Optimiser and schedule (the weights are saved separately, as safetensors)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.host is not None:  # the weights were loaded into the module: the host copies follow
            self.host.refresh()

    @property
    def optimizer_offload(self) -> bool:
        return self.host is not None

    def release_memory(self) -> None:
        """Let go of what the update leaves on the device while the engine decodes (colocated): the gradients
        (normally gone already after `optim_step`) and the blocks the CUDA allocator caches from the
        backward's activations."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
