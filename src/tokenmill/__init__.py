"""tokenmill: reinforcement-learning post-training for language models."""

from tokenmill.api import train
from tokenmill.config.schema import RLConfig, SFTConfig
from tokenmill.types import Completion, Group, Sample, SamplingParams, StopReason

__version__ = "0.1.0"
__all__ = ["Completion", "Group", "RLConfig", "SFTConfig", "Sample", "SamplingParams", "StopReason", "train"]
