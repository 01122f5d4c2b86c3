"""The weight-sync protocol: send the trainer's new weights to the engines that sample from them.

A `WeightSync` moves named tensors and the policy version they belong to; it knows nothing of optimisers or
losses. Three ways ship with tokenmill, all behind the same two methods:

- `InProcessSync(engine)` (`sync/inprocess.py`): the engine lives in the trainer's process; a copy in place.
- `FileSync(urls, folder)` (`sync/files.py`): a safetensors folder written atomically, then
  `POST /update_weights_from_disk` to every server (ours or SGLang).
- `BroadcastSync(urls)` (`sync/broadcast.py`): a torch.distributed group of the trainer (rank 0) and the
  servers (ranks 1..N), gloo on CPU or NCCL on GPU, driven by SGLang- or vLLM-shaped HTTP control routes.

The receiving side of the HTTP ways is `tokenmill.engines.server.weight_routes.weight_routes(engine)`.

    >>> from tokenmill.sync import InProcessSync
    >>> from tokenmill.engines.local.hf import HFEngine                              # doctest: +SKIP
    >>> sync = InProcessSync(HFEngine.from_pretrained("path/to/model"))       # doctest: +SKIP
    >>> sync.push(backend.weights(), version=1)                               # doctest: +SKIP
    >>> sync.close()                                                          # doctest: +SKIP

Names are the engine model's parameter names (Hugging Face names for a plain model). A LoRA trainer's
`backend.weights()` yields peft adapter names, which a server holding the plain (merged) model does not
have: push `merged_lora_weights(model)` instead (the adapted layers' W + scale * B @ A under the plain names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch

from tokenmill.types import TokenmillError

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(TokenmillError, RuntimeError):
    """A push that did not land; the message names the server (URL) and its reason."""


class ServerUnreachable(WeightSyncError):
    """A server that did not answer at all (connection refused or reset, timeout): with `drop_failed=True` a
    sync drops it and goes on with the others, while a server that answered with a refusal is never dropped."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


@runtime_checkable
class WeightSync(Protocol):
    """Sends weights to engines. After `push` returns, every engine samples from `named_tensors` and reports
    `version` as its policy version; on error it raises `WeightSyncError` and the engines keep what they had."""

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        """Deliver the tensors (a subset of the engine's parameters, by name) and the version they make."""
        ...

    def close(self) -> None:
        """Release groups, threads and temporary files; idempotent."""
        ...


def merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a server holding the plain base model needs to compute what a peft LoRA `model` computes:
    for every adapted layer, `base + delta` (peft's own `get_delta_weight`, so scaling and fan-in/fan-out
    layouts match) under the base model's name. Non-LoRA modules are not sent (frozen, the server has them)."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        with torch.no_grad():
            weight = base.weight.detach().clone()
            if not getattr(module, "merged", False):  # a merged layer's base weight already holds the delta
                for adapter in module.active_adapters:
                    if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}):
                        weight += module.get_delta_weight(adapter).to(weight.dtype)
        name = module_name.removeprefix(prefix)
        yield f"{name}.weight", weight


def check_engine_names(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, refusing peft adapter names early with the fix (a remote server has no adapters)."""
    for name, tensor in named_tensors:
        if ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name:
            raise WeightSyncError(
                f"tensor {name!r} is a LoRA adapter; a server holds the plain model: push "
                "tokenmill.sync.merged_lora_weights(model) instead of backend.weights()"
            )
        yield name, tensor
