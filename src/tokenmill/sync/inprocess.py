"""Weight sync to an engine in the trainer's own process: a copy in place (none at all for a shared module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.sync.base import NamedTensors, WeightSyncError

if TYPE_CHECKING:  # engines import sync (vLLM, the weight routes), never the other way at run time
    from tokenmill.engines.base import InferenceEngine


class InProcessSync:
    """`engine.update_weights(named_tensors, version)`, behind the `WeightSync` protocol. The engine may run the
    trainer's peft module, so LoRA adapter names are fine here (unlike the HTTP syncs).

    All or nothing, like the HTTP syncs: every tensor is checked against the engine's parameters (known name,
    same shape; the dtype is cast on copy) before anything is copied, so a refused push leaves the engine on
    the weights and version it had."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        tensors = list(named_tensors)
        model = getattr(self.engine, "model", None)
        if model is not None:
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            for name, tensor in tensors:
                if name not in shapes:
                    raise WeightSyncError(f"tensor {name!r}: no such parameter in the engine's model")
                if tuple(tensor.shape) != shapes[name]:
                    raise WeightSyncError(f"tensor {name!r}: shape {list(tensor.shape)} != the engine's "
                                          f"{list(shapes[name])}")
        self.engine.update_weights(tensors, version)

    def close(self) -> None:
        pass
