"""The thread placement's producer generates on a CUDA stream of its own on a GPU (and on none on a CPU);
weights pushed from the trainer's stream reach the engine whole."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenmill.controller.placement import ThreadPlacement
from tokenmill.engines import HFEngine


def _push_and_apply(tiny_model, tokenizer, device: str):
    trainer = tiny_model.to(device)
    copy = type(trainer)(trainer.config).to(device)
    placement = ThreadPlacement(HFEngine(copy, tokenizer))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.5)  # queued on the trainer's stream
    placement.push(trainer.named_parameters(), version=3)
    seen = {}

    def producer():
        with placement.stream():
            seen["stream"] = torch.cuda.current_stream() if device == "cuda" else None
            seen["applied"] = placement.apply_pending()
            if device == "cuda":
                torch.cuda.current_stream().synchronize()

    thread = threading.Thread(target=producer)
    thread.start()
    thread.join()
    for (name, p), q in zip(trainer.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert seen["applied"] and placement.engine.version == 3
    return seen


def test_on_a_cpu_the_producer_needs_no_stream(tiny_model, tokenizer):
    seen = _push_and_apply(tiny_model, tokenizer, "cpu")
    assert seen["stream"] is None


@pytest.mark.gpu
def test_on_a_gpu_the_producer_generates_on_its_own_stream(tiny_model, tokenizer):
    seen = _push_and_apply(tiny_model, tokenizer, "cuda")
    assert seen["stream"] != torch.cuda.default_stream()
