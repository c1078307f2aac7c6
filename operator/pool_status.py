"""Observations → GPUPool status: its nodes, capacity, what is claimed and requested of it, and
its Ready and Degraded conditions. Pure, like the InferenceService's (``status``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ladle.api import JSON, GPUPool
from ladle.operator.conditions import DEGRADED, READY, Condition, merge_conditions
from ladle.operator.quota import PoolPlan
from ladle.operator.store import NodeInfo, node_matches
from ladle.words import plural


@dataclass(frozen=True)
class PoolFacts:
    """What a GPUPool's status reports besides its nodes and its plan."""

    services: int
    # Other pools whose nodes overlap this one's: name → shared node count.
    overlaps: Mapping[str, int] = field(default_factory=dict)
    # InferenceServices (namespace/name) that keep a deleted pool alive.
    blocking_deletion: tuple[str, ...] = ()


def derive_pool_status(
    pool: GPUPool,
    nodes: Sequence[NodeInfo],
    plan: PoolPlan[Any],
    facts: PoolFacts,
    now: str,
    previous: Mapping[str, Any] | None = None,
) -> JSON:
    resource = pool.spec.resource_name
    matching = [n for n in nodes if node_matches(pool.spec, n)]
    schedulable = [n for n in matching if n.ready and not n.unschedulable]
    capacity = sum(n.gpus(resource) for n in matching)
    allocatable = sum(n.gpus(resource, allocatable=True) for n in schedulable)

    if allocatable > 0:
        ready = Condition(
            READY,
            True,
            "NodesAvailable",
            f"{plural(len(schedulable), 'schedulable node offers', 'schedulable nodes offer')} "
            f"{allocatable} {resource}",
        )
    elif matching:
        ready = Condition(
            READY,
            False,
            "NoSchedulableNodes",
            f"{plural(len(matching), 'node')} "
            f"{'matches' if len(matching) == 1 else 'match'} but none is ready and schedulable",
        )
    else:
        ready = Condition(READY, False, "NoMatchingNodes", f"no node matches and offers {resource}")

    problems: list[tuple[str, str]] = []
    if facts.blocking_deletion:
        problems.append(
            (
                "DeletionBlocked",
                f"deletion waits for {plural(len(facts.blocking_deletion), 'InferenceService')} "
                f"that still use this pool: {', '.join(facts.blocking_deletion[:10])}",
            )
        )
    if plan.requested_gpus > plan.claimed_gpus:
        withheld = plan.requested_gpus - plan.claimed_gpus
        problems.append(
            (
                "QuotaExceeded",
                f"InferenceServices request {plural(plan.requested_gpus, 'GPU')} but the quota "
                f"is {plan.quota_gpus}; {plural(withheld, 'GPU is', 'GPUs are')} withheld",
            )
        )
    if plan.claimed_gpus > allocatable:
        problems.append(
            (
                "OverCommitted",
                f"{plural(plan.claimed_gpus, 'GPU is', 'GPUs are')} claimed but only "
                f"{plural(allocatable, 'is', 'are')} allocatable",
            )
        )
    if facts.overlaps:
        shared = ", ".join(
            f"{plural(count, 'node')} with GPUPool {name}"
            for name, count in sorted(facts.overlaps.items())
        )
        problems.append(
            (
                "OverlappingPools",
                f"shares {shared}: their GPUs are counted in each pool, and the quotas do not "
                "add up",
            )
        )
    degraded = (
        Condition(DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems))
        if problems
        else Condition(DEGRADED, False, "AsExpected")
    )
    generation = pool.meta.generation
    return {
        "observedGeneration": generation,
        "nodes": len(matching),
        "capacity": capacity,
        "allocatable": allocatable,
        "held": plan.held_gpus,
        "claimed": plan.claimed_gpus,
        "requested": plan.requested_gpus,
        "inferenceServices": facts.services,
        "conditions": merge_conditions(
            (pool.status if previous is None else previous).get("conditions") or (),
            [ready, degraded],
            generation,
            now,
        ),
    }
