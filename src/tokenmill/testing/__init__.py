"""Tiny local models and tokenizers, synthetic verifiable tasks, for tests, examples and the quickstart."""

from tokenmill.testing.tasks import (
    addition_dataset,
    addition_reward,
    countdown_dataset,
    countdown_reward,
    task_splits,
)
from tokenmill.testing.tiny import build_tiny_model, build_tokenizer

__all__ = [
    "addition_dataset",
    "addition_reward",
    "build_tiny_model",
    "build_tokenizer",
    "countdown_dataset",
    "countdown_reward",
    "task_splits",
]
