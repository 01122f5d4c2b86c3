"""Configuration: pydantic schema, YAML loading, dotted CLI overrides, readable errors."""

from tokenmill.config.load import format_validation_error, load_config, parse_overrides
from tokenmill.config.offline import OfflineConfig, PreferenceConfig, SFTConfig
from tokenmill.config.rewards import (
    RewardBuiltinConfig,
    RewardFunctionConfig,
    RewardJudgeConfig,
    RewardModelConfig,
)
from tokenmill.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ControllerConfig,
    CriticConfig,
    DataConfig,
    EnvConfig,
    GenerationConfig,
    ModelConfig,
    OptimConfig,
    RLConfig,
    TrackingConfig,
    TrainingConfig,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ControllerConfig",
    "CriticConfig",
    "DataConfig",
    "EnvConfig",
    "GenerationConfig",
    "ModelConfig",
    "OfflineConfig",
    "OptimConfig",
    "PreferenceConfig",
    "RLConfig",
    "RewardBuiltinConfig",
    "RewardFunctionConfig",
    "RewardJudgeConfig",
    "RewardModelConfig",
    "SFTConfig",
    "TrackingConfig",
    "TrainingConfig",
    "format_validation_error",
    "load_config",
    "parse_overrides",
]
