"""Inference engines: the protocol and the in-process transformers engine."""

from tokenmill.engines.base import InferenceEngine
from tokenmill.engines.local.hf import HFEngine
from tokenmill.engines.local.sampling import sample_tokens

__all__ = ["HFEngine", "InferenceEngine", "sample_tokens"]
