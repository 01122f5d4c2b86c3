"""Inference engines: the protocol (`base`) and one sub-package per role: `local` (the model in this process),
`server` (`tokenmill serve`), `remote` (clients of OpenAI-compatible servers), `vllm`. Exported here: the
protocol, the in-process transformers engine and its sampler."""

from tokenmill.engines.base import InferenceEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.sampling import sample_tokens

__all__ = ["HFEngine", "InferenceEngine", "sample_tokens"]
