"""Timing by stage, throughput, bottleneck, and metric sinks."""

from tokenmill.tracking.logger import MetricsLogger
from tokenmill.tracking.stages import StageTimer, stage, step_timer

__all__ = ["MetricsLogger", "StageTimer", "stage", "step_timer"]
