"""The scheduling benchmark's lower bounds (bench/scheduling.py): ``--bounds`` computes what the
simulator reports, and the latency goal's verdict tells a miss from an impossible goal.

The benchmark's numbers are not asserted, only where they come from.
"""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

from runtime.scheduler import make_scheduler
from runtime.sim.engine import simulate

sched = load_bench("scheduling")


def test_the_latency_goal_is_unreachable_only_past_the_throughput_bound() -> None:
    assert sched.latency_goal(1.25, 1.0, 1.0) == "met"
    assert sched.latency_goal(2.0, 1.2, 1.0) == "missed"
    assert sched.latency_goal(2.0, 1.4, 1.0) == "unreachable"


@pytest.mark.skipif(not sched.DATA.is_dir(), reason="shared traces not present")
def test_bounds_are_what_the_simulator_reports() -> None:
    groups, actual, ptok, n = sched.setup("seqsched", 0.0, 0)
    instances, sim = sched.cluster(16, n, 1)
    fifo = make_scheduler("fifo", groups, instances, **sim)
    result = simulate(fifo, groups, actual, instances, **sim, prompt_tokens=ptok)
    throughput, latency = sched.bounds("seqsched", 16, 1, 0)
    assert throughput == pytest.approx(result.lower_bound_s)
    assert latency == pytest.approx(result.latency_lower_bound_s)
    assert result.iteration_s >= max(throughput, latency)
