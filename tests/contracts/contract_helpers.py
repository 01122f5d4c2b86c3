"""Helpers for the contract tests: perturbed weights, and an engine server on a loopback port (a
ContinuousEngine behind the OpenAI and weight routes, in a thread)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every weight moved by seeded noise (a 'trained' policy)."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


@dataclass
class Served:
    url: str
    engine: object  # the ContinuousEngine behind the server


@contextmanager
def served(model_path: str) -> Iterator[Served]:
    """A real `create_app` server on 127.0.0.1 (free port) over a fresh engine; stopped on exit."""
    from tokenmill.engines.local.continuous import ContinuousEngine
    from tokenmill.engines.server.app import create_app
    from tokenmill.serving import start_in_thread

    engine = ContinuousEngine.from_pretrained(model_path, max_batch=16)
    server, _ = start_in_thread(create_app(engine, model_name="tiny"))
    try:
        yield Served(server.url, engine)
    finally:
        server.stop()
        engine.close()
