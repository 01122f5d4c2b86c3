"""Single-process torch backend: micro-batches, gradient accumulation, AdamW, warm-up + decay, clipping."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from tokenmill.training.base import BatchLoss
from tokenmill.training.batch import Batch


def token_logprobs(logits_B_T_V: torch.Tensor, input_ids_B_T: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every position, aligned with the tokens (position 0 gets 0).

    Computed as gathered logit minus logsumexp, in fp32, so no full log-softmax tensor is kept for
    backward (the term that dominates memory for large vocabularies).
    """
    logits = logits_B_T_V[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets_B_T = input_ids_B_T[:, 1:]
    picked = logits.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits_B_T_V: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, aligned like `token_logprobs`."""
    logits = logits_B_T_V[:, :-1, :].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


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


class LocalBackend:
    """Trains one module in this process. `temperature` matches the sampler's (logits are divided by it)."""

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
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=learning_rate, betas=betas, weight_decay=weight_decay, foreach=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(lr_schedule, warmup_steps, total_steps)
        )
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.track_entropy = track_entropy

    def _logits(self, input_ids_B_T: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids_B_T, use_cache=False).logits

    def forward_backward(self, batch: Batch, loss_fn: BatchLoss) -> dict[str, float]:
        self.model.train()
        totals: dict[str, float] = {}
        for micro in batch.micro_batches(self.micro_batch_tokens):
            micro = micro.to(self.device)
            logits_B_T_V = self._logits(micro.input_ids_B_T)
            logprobs_B_T = token_logprobs(logits_B_T_V, micro.input_ids_B_T, self.temperature)
            loss, metrics = loss_fn(logprobs_B_T, micro)
            if self.track_entropy:
                with torch.no_grad():
                    ent = token_entropy(logits_B_T_V.detach(), self.temperature)
                    metrics["entropy"] = (ent * micro.weights_B_T).sum()
            loss.backward()
            metrics["loss"] = loss.detach()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return totals

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.old_logprobs_B_T)
        start = 0
        for micro in batch.micro_batches(self.micro_batch_tokens):
            ids = micro.input_ids_B_T.to(self.device)
            lp = token_logprobs(self._logits(ids), ids, self.temperature)
            out[start : start + micro.size, : lp.shape[1]] = lp.cpu()
            start += micro.size
        return out

    def optim_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": lr}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
