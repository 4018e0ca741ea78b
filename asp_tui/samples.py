"""Fixed, deterministic snapshots: snapshot tests and ``bench/dashboard.py`` render these.

They are built from a seed alone (no clock, no randomness from the environment), so the same
call gives the same screen on every machine.
"""

from __future__ import annotations

import math
import random

from runtime.protocol import Event, InstanceSnapshot, LagStats, Lane, Snapshot, TrainerSnapshot

BASE_TIME = 1_780_000_000.0
"""A fixed wall-clock time for sample data (2026-05-28 UTC)."""


def sample_instances(count: int, step: int, seed: int = 0) -> list[InstanceSnapshot]:
    rng = random.Random(seed * 7919 + step)
    instances = []
    for i in range(count):
        state = "running"
        if i % 11 == 3:
            state = "paused"
        elif i % 17 == 5:
            state = "syncing"
        elif i % 29 == 7:
            state = "down"
        running = 0 if state in {"paused", "down"} else rng.randint(4, 16)
        version = step - (1 if state == "syncing" or i % 5 == 0 else 0)
        instances.append(
            InstanceSnapshot(
                instance_id=i,
                state=state,
                in_flight_groups=0 if state == "down" else max(running // 4, 1),
                running_seqs=running,
                max_num_seqs=16,
                tokens_per_s=0.0 if state in {"paused", "down"} else 380.0 + 40 * rng.random(),
                weight_version=max(version, 0),
                versions_behind=max(step - version, 0),
                bubble_share=round(0.05 + 0.3 * rng.random(), 3),
                restarts=1 if state == "down" else 0,
                lane=Lane.TAIL if i % 8 == 6 else Lane.BULK,
            )
        )
    return instances


def sample_snapshot(
    count: int = 8, step: int = 42, seq: int = 420, seed: int = 0, run_name: str = "sim-demo"
) -> Snapshot:
    """A busy mid-run snapshot: some paused, syncing and down instances, a full-ish queue."""
    wave = math.sin(step / 5)
    return Snapshot(
        run_name=run_name,
        time=BASE_TIME + seq / 10,
        seq=seq,
        state="running",
        step=step,
        total_steps=200,
        weight_version=step,
        lag_bound=2,
        on_lag_decrease="wait",
        batch_groups=8,
        queue_depth=11 + int(4 * wave),
        queue_capacity=24,
        in_flight_groups=max(count // 2, 1),
        admitted_groups=(step + 2) * 8 + 5,
        consumed_groups=step * 8,
        discarded_groups=0,
        requeued_groups=3,
        deferred_groups=step // 3,
        migrated_groups=step // 5,
        lag=LagStats(mean=0.84, p95=2.0, max=2, span_max=1, histogram=[51, 198, 87]),
        trainer=TrainerSnapshot(
            state="training",
            reward_mean=0.31 + 0.004 * step,
            loss=0.52 - 0.003 * step,
            iteration_s=2.9 + 0.2 * wave,
            samples_per_s=88.0 + 5 * wave,
            tokens_per_s=21_000.0,
            wait_batch_s=0.4 + 0.1 * wave,
            train_s=2.3,
            sync_s=0.2,
            deferred=int(step % 3 == 0),
            migrated=int(step % 5 == 0),
            predictor_longest_rho=round(0.6 + 0.2 * math.sin(step / 3), 3),
            predictor_longest_ratio=1.08,
        ),
        bubbles_window={
            "useful": 0.58,
            "padding": 0.14,
            "skewness": 0.09,
            "sorting": 0.06,
            "sync": 0.05,
            "paused": 0.05,
            "down": 0.02,
            "idle": 0.01,
        },
        bubbles_total={
            "useful": 0.63,
            "padding": 0.12,
            "skewness": 0.08,
            "sorting": 0.05,
            "sync": 0.06,
            "paused": 0.03,
            "down": 0.01,
            "idle": 0.02,
        },
        instances=sample_instances(count, step, seed),
    )


def sample_history(count: int = 8, steps: int = 40, seed: int = 0) -> list[Snapshot]:
    """One snapshot per second for ``steps`` trainer steps: what ``history`` would return."""
    return [
        sample_snapshot(count, step=step, seq=step * 10, seed=seed) for step in range(1, steps + 1)
    ]


def sample_events(step: int = 42) -> list[Event]:
    t = BASE_TIME + step
    return [
        Event(time=t - 9, kind="weights", message=f"version {step - 1} synced to 8 instances"),
        Event(time=t - 6, kind="operator", message="instance 3 paused (pause_instance)"),
        Event(time=t - 4, kind="state", message="instance 7 down: heartbeat timeout (10s)"),
        Event(time=t - 1, kind="weights", message=f"version {step} synced to 7 instances"),
    ]
