"""``fifo``: dataset order, round robin over instances (what verl and OpenRLHF do)."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.scheduler.base import GroupSpec, InstanceSpec, Plan, chunk_cuts


def minibatch_size(spec: InstanceSpec, n: int) -> int:
    """Groups that fill an instance once: its minibatch."""
    return max(1, spec.max_num_seqs // max(1, n))


def round_robin(
    order: Sequence[int], groups: Sequence[GroupSpec], instances: Sequence[InstanceSpec]
) -> Plan:
    """Deal ``order`` (group indices) to the instances in turn, weighted by concurrency: each
    turn gives an instance one minibatch-worth share in proportion to its C_i."""
    ids = [s.instance_id for s in instances]
    queues: dict[int, list[int]] = {i: [] for i in ids}
    if not ids:
        return Plan(queues, {i: [0] for i in ids})
    caps = [s.max_num_seqs for s in instances]
    if len(set(caps)) == 1:
        for k, g in enumerate(order):
            queues[ids[k % len(ids)]].append(g)
    else:
        # Smooth weighted round robin, so an instance with twice the slots gets twice the groups.
        credit = [0.0] * len(ids)
        total = float(sum(caps))
        for g in order:
            for j, c in enumerate(caps):
                credit[j] += c
            j = max(range(len(ids)), key=credit.__getitem__)
            credit[j] -= total
            queues[ids[j]].append(g)
    n = groups[0].n if groups else 1
    cuts = {
        s.instance_id: chunk_cuts(len(queues[s.instance_id]), minibatch_size(s, n))
        for s in instances
    }
    return Plan(queues, cuts)


def plan_fifo(groups: Sequence[GroupSpec], instances: Sequence[InstanceSpec]) -> Plan:
    return round_robin(range(len(groups)), groups, instances)
