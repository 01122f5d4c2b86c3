"""Rewards: functions (TRL signature), reward models and weighted sets, each call contained."""

from tokenmill.rewards.base import FunctionReward, Reward
from tokenmill.rewards.model import ModelReward
from tokenmill.rewards.set import RewardSet

__all__ = ["FunctionReward", "ModelReward", "Reward", "RewardSet"]
