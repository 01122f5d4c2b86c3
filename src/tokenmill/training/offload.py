"""AdamW with its state in CPU memory (`training.optimizer_offload`).

The optimiser steps on fp32 CPU copies of the trained parameters: each step copies the gradients to them
(pinned memory on a GPU, so the copies are DMA transfers), runs the fused CPU AdamW, and copies the updated
weights back into the device parameters. The GPU keeps the weights and, during the backward, the gradients;
AdamW's two moments (8 bytes per trained parameter) live on the host. The same arithmetic as AdamW on the
device, so the same weights (tests/unit/training/test_offload.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HostCopies:
    """fp32 CPU copies of `params`, the ones an offloaded optimiser steps on; `to_host` moves the gradients
    there, `to_device` the updated weights back."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        pin = any(p.device.type == "cuda" for p in params)
        self.copies = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, pin_memory=pin))
                       for p in params]
        self.grads = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin) for p in params]
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Take the device weights (at the start, and after weights were loaded from a checkpoint)."""
        for p, c in zip(self.params, self.copies, strict=True):
            c.copy_(p.detach())
        self._sync()

    @torch.no_grad()
    def to_host(self) -> None:
        for p, c, g in zip(self.params, self.copies, self.grads, strict=True):
            if p.grad is None:
                c.grad = None
                continue
            g.copy_(p.grad, non_blocking=True)
            c.grad = g
        self._sync()

    @torch.no_grad()
    def to_device(self) -> None:
        for p, c in zip(self.params, self.copies, strict=True):
            p.copy_(c, non_blocking=True)
        self._sync()

    def zero_grad(self) -> None:
        for p, c in zip(self.params, self.copies, strict=True):
            p.grad = c.grad = None

    def _sync(self) -> None:
        if any(p.device.type == "cuda" for p in self.params[:1]):
            torch.cuda.synchronize()


def offloaded(params: list[torch.nn.Parameter], make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
              ) -> tuple[torch.optim.Optimizer, HostCopies]:
    """The optimiser `make` builds over the host copies of `params`, and the copies."""
    host = HostCopies(params)
    return make(host.copies), host
