"""GPUPool quota: how many replicas each InferenceService in a pool may run, and which may surge.

The plan is a pure function of the pool's quota and every claim in it, so concurrent
reconciles that see the same cache compute the same answer. It is made in two steps.

**Entitlement** (who should get what, ignoring pods that are still starting or draining):

0. Every service is guaranteed ``min(requested, minReplicas, fair share)`` replicas, where the
   fair share is the quota divided evenly among the services that ask for GPUs. A newcomer is
   therefore never starved by older services growing: it takes GPUs back from replicas that
   run above their own guarantee.
1. Replicas already granted are kept next, oldest InferenceService first, so that scaling one
   service up never evicts another service's running replicas.
2. What is left goes to outstanding demand, oldest first (first come, first served).

**What pods really hold.** A pod holds its GPUs from the moment it exists until it is gone,
including while it drains after its service shrank or was deleted, and a rolling update's
surge pod holds a spare replica's worth. A service's use of the pool is the larger of its
grant and what its pods hold; pods of deleted services (``orphan_gpus``) count until they end.
A service whose entitlement grows is granted the extra replicas only once that use fits in
the quota, in entitlement order; one whose entitlement shrinks is cut at once (its pods then
drain, and the GPUs pass on when they are gone).

**Surge.** A service whose rollout is due (``wants_surge``) may run one extra replica during
the rollout if the quota and the pool's free GPUs have room for it, oldest first; otherwise it
replaces replicas one at a time (see ``desired.rollout_strategy``).
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
    # The floor this service is guaranteed, before the fair-share cap (spec.minReplicas).
    min_replicas: int = 1
    # GPUs its pods hold right now, whatever their state.
    held_gpus: int = 0
    # A rollout of this service is due or under way.
    wants_surge: bool = False


@dataclass(frozen=True)
class PoolPlan(Generic[K]):
    granted: dict[K, int]
    surge: frozenset[K]
    quota_gpus: int | None
    # GPUs counted against the quota: each service's grant (plus a surge replica) or what its
    # pods hold, whichever is larger, plus what pods of deleted services still hold.
    claimed_gpus: int
    requested_gpus: int
    held_gpus: int
    # Replicas guaranteed to each service (the fairness floor).
    guaranteed: dict[K, int]


def _usage(claim: Claim[K], replicas: int, surge: bool = False) -> int:
    extra = 1 if surge else 0
    return max((replicas + extra) * claim.gpus_per_replica, claim.held_gpus)


def entitlement(quota_gpus: int, claims: list[Claim[K]]) -> tuple[dict[K, int], dict[K, int]]:
    """(entitled replicas, guaranteed replicas) per key, ignoring what pods hold."""
    gpu_claims = [c for c in claims if c.gpus_per_replica > 0 and c.requested_replicas > 0]
    share = quota_gpus // len(gpu_claims) if gpu_claims else 0
    guaranteed: dict[K, int] = {}
    entitled: dict[K, int] = {}
    remaining = quota_gpus
    for claim in claims:  # CPU-only replicas need no GPU: grant them outright
        if claim.gpus_per_replica == 0:
            entitled[claim.key] = guaranteed[claim.key] = claim.requested_replicas
    gpu_ordered = [c for c in claims if c.gpus_per_replica > 0]

    def give(claim: Claim[K], target: int) -> None:
        nonlocal remaining
        have = entitled.get(claim.key, 0)
        more = min(max(target - have, 0), remaining // claim.gpus_per_replica)
        entitled[claim.key] = have + more
        remaining -= more * claim.gpus_per_replica

    for claim in gpu_ordered:  # pass 0: the guaranteed floor
        floor = min(claim.requested_replicas, claim.min_replicas, share // claim.gpus_per_replica)
        give(claim, floor)
        guaranteed[claim.key] = entitled[claim.key]
    for claim in gpu_ordered:  # pass 1: keep what is already running
        give(claim, min(claim.requested_replicas, claim.current_replicas))
    for claim in gpu_ordered:  # pass 2: grow, oldest first
        give(claim, claim.requested_replicas)
    return entitled, guaranteed


def plan_pool(
    quota_gpus: int | None,
    claims: Iterable[Claim[K]],
    *,
    orphan_gpus: int = 0,
    free_gpus: int | None = None,
) -> PoolPlan[K]:
    """Plan one pool. ``free_gpus`` is the pool's allocatable GPUs that no runtime pod holds
    (None: unknown), which bounds surging even where no quota does."""
    ordered = sorted(claims, key=lambda c: (c.created, str(c.key)))
    requested = sum(c.requested_replicas * c.gpus_per_replica for c in ordered)
    held = orphan_gpus + sum(c.held_gpus for c in ordered)
    if quota_gpus is None:
        granted = {c.key: c.requested_replicas for c in ordered}
        guaranteed = dict(granted)
    else:
        budget = max(quota_gpus - orphan_gpus, 0)
        entitled, guaranteed = entitlement(budget, ordered)
        # Shrinking services are cut at once (their draining pods stay counted as held);
        # growing ones start from what they have.
        granted = {c.key: min(entitled[c.key], c.current_replicas) for c in ordered}
        used = orphan_gpus + sum(_usage(c, granted[c.key]) for c in ordered)
        # Growing services: the guaranteed floor first, then the rest, in entitlement order.
        for goal in (guaranteed, entitled):
            for claim in ordered:
                target = goal[claim.key]
                while granted[claim.key] < target:
                    before = _usage(claim, granted[claim.key])
                    after = _usage(claim, granted[claim.key] + 1)
                    if used - before + after > quota_gpus:
                        break
                    granted[claim.key] += 1
                    used += after - before
    used = orphan_gpus + sum(_usage(c, granted[c.key]) for c in ordered)
    surge: set[K] = set()
    free = free_gpus
    for claim in ordered:
        if not claim.wants_surge or claim.gpus_per_replica == 0 or granted[claim.key] == 0:
            continue
        extra = _usage(claim, granted[claim.key], True) - _usage(claim, granted[claim.key])
        if quota_gpus is not None and used + extra > quota_gpus:
            continue
        if free is not None and extra > free:
            continue
        surge.add(claim.key)
        used += extra
        if free is not None:
            free -= extra
    return PoolPlan(
        granted=granted,
        surge=frozenset(surge),
        quota_gpus=quota_gpus,
        claimed_gpus=used,
        requested_gpus=requested,
        held_gpus=held,
        guaranteed=guaranteed,
    )
