"""Drive tokenmill's trainer from your own loop: sample, forward_backward, optim_step, save and load, on
LoRA adapters of one shared base model, in-process or over HTTP (`tokenmill serve-trainer`). See docs/client.md.
"""

from tokenmill.client.api import (
    AdamParams,
    Datum,
    SampledSequence,
    SampleResult,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)
from tokenmill.client.service import RequestError, TrainerService
from tokenmill.types import SamplingParams

__all__ = ["AdamParams", "Datum", "RequestError", "SampleResult", "SampledSequence", "SamplingClient",
           "SamplingParams", "ServiceClient", "TrainerService", "TrainingClient"]
