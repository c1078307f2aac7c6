"""Canary split: which variant of a service serves a request.

The weights are the service's ``status.rollout.weights`` (percent per variant), written by the
rollout controller; without them the stable variant takes everything. A variant with no ready
pod gives its share to the others (never to a variant whose weight is 0). A request with a
session key (``x-session-id`` or the body's ``user``) always lands on the same variant while
the weights hold, since its point in [0, 1) comes from a stable hash of the key.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from ladle.gateway.picker import stable_hash

_SCALE = float(1 << 64)


def choose_variant(
    weights: Sequence[tuple[str, int]],
    available: Collection[str],
    *,
    rng: random.Random,
    sticky: bytes | None = None,
) -> str | None:
    """A variant among ``available`` with weight > 0, drawn by weight; None if there is none."""
    live = [(name, w) for name, w in weights if w > 0 and name in available]
    if not live:
        return None
    if len(live) == 1:
        return live[0][0]
    total = sum(w for _, w in live)
    point = (stable_hash(sticky) / _SCALE if sticky is not None else rng.random()) * total
    for name, weight in live:
        point -= weight
        if point < 0:
            return name
    return live[-1][0]
