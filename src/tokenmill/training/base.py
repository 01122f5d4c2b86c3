"""The training-backend protocol: the loop sees these few verbs whatever runs underneath.

    >>> backend = LocalBackend(model, learning_rate=1e-5, total_steps=100)        # doctest: +SKIP
    >>> metrics = backend.forward_backward(batch, loss_fn)                        # doctest: +SKIP
    >>> backend.optim_step()["grad_norm"]                                         # doctest: +SKIP
    >>> backend.load_state_dict(backend.state_dict())  # optimiser + schedule, for resume  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from tokenmill.training.batch import Batch

# loss_fn(logprobs_B_T, batch) -> (scalar loss, metrics summed with the batch weights)
BatchLoss = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainBackend(Protocol):
    def forward_backward(self, batch: Batch, loss_fn: BatchLoss, entropy_coef: float = 0.0) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` (minus an entropy bonus when `entropy_coef` > 0) over the batch
        (micro-batched inside); return summed metrics."""
        ...

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logprobs of `batch.input_ids_B_T` (no gradient), aligned with the tokens."""
        ...

    def optim_step(self) -> dict[str, float]:
        """Clip, step the optimiser and the LR schedule, zero the gradients; return grad_norm and the lr
        applied. A non-finite grad_norm is not applied (weights and optimiser state unchanged, the schedule
        advances) and adds `skipped_nonfinite: 1` to the metrics."""
        ...

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current parameters by name, for weight sync and export."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Optimiser and schedule state for an exact resume (weights are saved from the module)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (after the module's weights are loaded)."""
        ...
