"""Training backends (the loop sees forward_backward / forward / optim_step), batches, policy updates."""

from tokenmill.training.base import TrainBackend
from tokenmill.training.batch import Batch, collate
from tokenmill.training.local import LocalBackend, ReferenceModel, token_logprobs
from tokenmill.training.update import policy_update

__all__ = ["Batch", "LocalBackend", "ReferenceModel", "TrainBackend", "collate", "policy_update", "token_logprobs"]
