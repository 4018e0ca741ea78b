"""Rollout scheduling: the policies (fifo, sorted, asp), length sources and the cost model."""

from runtime.scheduler.base import GroupSpec, InstanceSpec, Plan, PlannedScheduler, Scheduler
from runtime.scheduler.cost_model import CostModel
from runtime.scheduler.lengths import (
    LengthHistory,
    LengthsFileError,
    LengthTable,
    predictor_quality,
    read_lengths,
)
from runtime.scheduler.policies import POLICIES, make_scheduler

__all__ = [
    "POLICIES",
    "CostModel",
    "GroupSpec",
    "InstanceSpec",
    "LengthHistory",
    "LengthTable",
    "LengthsFileError",
    "Plan",
    "PlannedScheduler",
    "Scheduler",
    "make_scheduler",
    "predictor_quality",
    "read_lengths",
]
