"""``sorted``: length-sorted dispatch, shortest first (as SortedRL does), round robin."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.scheduler.base import GroupSpec, InstanceSpec, Plan, Predictions
from runtime.scheduler.fifo import round_robin


def plan_sorted(
    groups: Sequence[GroupSpec],
    instances: Sequence[InstanceSpec],
    predictions: Predictions | None = None,
) -> Plan:
    # Sort on the predicted longest member: it decides when a group (and its minibatch) ends.
    key = (predictions or Predictions.of(groups)).longest
    order = np.argsort(key, kind="stable")
    return round_robin(order.tolist(), groups, instances)
