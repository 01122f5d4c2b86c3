"""Timing by stage, throughput, bottleneck, metric sinks, and the stage events live views tail."""

from tokenmill.tracking.base import Tracker
from tokenmill.tracking.events import EventLog, emit_stage
from tokenmill.tracking.logger import MetricsLogger
from tokenmill.tracking.stages import StageTimer, stage, step_timer

__all__ = ["EventLog", "MetricsLogger", "StageTimer", "Tracker", "emit_stage", "stage", "step_timer"]
