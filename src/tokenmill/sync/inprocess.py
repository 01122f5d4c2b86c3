"""Weight sync to an engine in the trainer's own process: a copy in place (none at all for a shared module)."""

from __future__ import annotations

from tokenmill.engines.base import InferenceEngine
from tokenmill.sync.base import NamedTensors


class InProcessSync:
    """`engine.update_weights(named_tensors, version)`, behind the `WeightSync` protocol. The engine may run the
    trainer's peft module, so LoRA adapter names are fine here (unlike the HTTP syncs)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def close(self) -> None:
        pass
