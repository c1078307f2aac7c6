"""Pod picking: least outstanding requests, with prefix affinity by consistent hashing with
bounded loads (CHWBL, as KubeAI's PrefixHash does).

Requests whose prompts share a prefix hash to the same point on a ring of virtual nodes, and
walk clockwise to the first pod whose load stays within ``load_factor`` times the mean; so a
shared system prompt keeps landing where its KV blocks are cached until that pod is busier than
its share, and then spills to the next pod on the ring, never to all of them. Without a prefix
the least-loaded pod wins. The pods' own scraped queue length and KV usage break ties and steer
away from saturated pods. Pure: the caller passes the candidates, their loads and a random
source.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

VIRTUAL_NODES = 256
# A pod whose KV cache is this full, or whose queue this long, is avoided while others are not.
SATURATED_KV = 0.95
SATURATED_WAITING = 16


def stable_hash(data: bytes) -> int:
    """64 bits that every gateway replica computes alike (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Candidate:
    """A pod as the picker sees it: ready, in rotation, with its current load."""

    name: str
    outstanding: int  # requests this gateway has in flight to the pod
    waiting: float | None = None  # scraped ladle:num_requests_waiting
    kv_usage: float | None = None  # scraped ladle:kv_cache_usage_perc

    @property
    def saturated(self) -> bool:
        return (self.kv_usage is not None and self.kv_usage >= SATURATED_KV) or (
            self.waiting is not None and self.waiting >= SATURATED_WAITING
        )

    def tie_break(self) -> tuple[float, float]:
        return (self.waiting or 0.0, self.kv_usage or 0.0)


class HashRing:
    """``VIRTUAL_NODES`` points per pod; built once per pod set and shared by requests."""

    def __init__(self, pods: Sequence[str]) -> None:
        points = sorted(
            (stable_hash(f"{pod}#{i}".encode()), pod) for pod in pods for i in range(VIRTUAL_NODES)
        )
        self.pods = frozenset(pods)
        self._hashes = [h for h, _ in points]
        self._owners = [pod for _, pod in points]

    def walk(self, key: bytes) -> list[str]:
        """Distinct pods in ring order, starting at the key's point."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, stable_hash(key))
        seen: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n])
            if len(seen) == len(self.pods):
                break
        return list(seen)


def bounded_capacity(total: int, pods: int, load_factor: float) -> int:
    """The most requests one pod may hold after this one is placed: ceil(c·(m+1)/n)."""
    return max(1, math.ceil(load_factor * (total + 1) / pods))


def pick(
    candidates: Sequence[Candidate],
    *,
    rng: random.Random,
    key: bytes | None = None,
    ring: HashRing | None = None,
    load_factor: float = 1.25,
) -> Candidate | None:
    """The pod for one request, or None when there is no candidate.

    Every candidate is eligible (the caller has removed unready, ejected and already-tried
    pods); saturated pods are passed over while any other is left."""
    if not candidates:
        return None
    pool = [c for c in candidates if not c.saturated] or list(candidates)
    if key is not None and ring is not None and len(pool) > 1:
        by_name = {c.name: c for c in pool}
        cap = bounded_capacity(sum(c.outstanding for c in pool), len(pool), load_factor)
        for name in ring.walk(key):
            chosen = by_name.get(name)
            if chosen is not None and chosen.outstanding + 1 <= cap:
                return chosen
    return least_loaded(pool, rng)


def least_loaded(pool: Sequence[Candidate], rng: random.Random) -> Candidate:
    best = min(pool, key=lambda c: (c.outstanding, c.tie_break()))
    ties = [
        c for c in pool if (c.outstanding, c.tie_break()) == (best.outstanding, best.tie_break())
    ]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
