"""GPUPool quota: how many replicas each InferenceService in a pool may run.

The plan is a pure function of the pool's quota and every claim in it, so concurrent
reconciles that see the same cache compute the same answer. Two rules keep it fair and stable:

1. Replicas already granted are kept first, oldest InferenceService first, so that scaling one
   service up never evicts another service's running replicas.
2. What is left goes to outstanding demand, oldest first (first come, first served).

Only a quota that shrinks below the current claims takes replicas away, newest first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Claim(Generic[K]):
    key: K
    # metadata.creationTimestamp (RFC 3339, so it sorts as text); ties break on the key.
    created: str
    requested_replicas: int
    gpus_per_replica: int
    # Replicas granted so far (the last plan, or the live Deployment after a restart).
    current_replicas: int = 0


@dataclass(frozen=True)
class PoolPlan(Generic[K]):
    granted: dict[K, int]
    quota_gpus: int | None
    claimed_gpus: int
    requested_gpus: int


def plan_pool(quota_gpus: int | None, claims: Iterable[Claim[K]]) -> PoolPlan[K]:
    ordered = sorted(claims, key=lambda c: (c.created, str(c.key)))
    requested = sum(c.requested_replicas * c.gpus_per_replica for c in ordered)
    granted: dict[K, int] = {}
    if quota_gpus is None:
        granted.update((c.key, c.requested_replicas) for c in ordered)
        return PoolPlan(granted, None, requested, requested)

    remaining = quota_gpus
    for claim in ordered:  # pass 1: keep what is already running
        keep = min(claim.requested_replicas, claim.current_replicas)
        if claim.gpus_per_replica > 0:
            keep = min(keep, remaining // claim.gpus_per_replica)
            remaining -= keep * claim.gpus_per_replica
        granted[claim.key] = max(keep, 0)
    for claim in ordered:  # pass 2: grow, oldest first
        want = claim.requested_replicas - granted[claim.key]
        if want <= 0:
            continue
        if claim.gpus_per_replica > 0:
            want = min(want, remaining // claim.gpus_per_replica)
            remaining -= want * claim.gpus_per_replica
        granted[claim.key] += want
    claimed = sum(granted[c.key] * c.gpus_per_replica for c in ordered)
    return PoolPlan(granted, quota_gpus, claimed, requested)
