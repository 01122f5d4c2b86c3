"""Rewards: functions called as TRL calls them, reward models and weighted sets, each call contained."""

from tokenmill.rewards.base import FunctionReward, Reward, RewardState
from tokenmill.rewards.model import ModelReward
from tokenmill.rewards.set import RewardSet
from tokenmill.rewards.watch import RewardFailureError, RewardFailureWatch

__all__ = ["FunctionReward", "ModelReward", "Reward", "RewardFailureError", "RewardFailureWatch", "RewardSet",
           "RewardState"]
