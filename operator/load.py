"""What one autoscaler tick sees, and the demand it reads there.

The runtime pods' gauges (``ladle:num_requests_running``, ``ladle:num_requests_waiting``, KV
usage) and the gateways' counts (in flight, held, arrivals) become requests in flight, the
concurrency that held requests stand for, and the arrivals' growth. Whatever cannot be read is
a problem to name, never zero load: ``scaling.decide`` holds the count on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from ladle.operator import load_window
from ladle.operator.pace import at_target

# The gateway's backlog is work to finish within this many pod starts (in the simulated
# bursts, one start cost 1.4% more GPU-hours for 1.7% less wait).
BACKLOG_STARTS = 2.0


@dataclass(frozen=True)
class PodLoad:
    """One ready pod's scrape: its gauges, or why they could not be read."""

    name: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    error: str | None = None
    # ``ladle:inter_token_latency_seconds``'s sum and count, for the pace (None: not exposed).
    itl_sum: float | None = None
    itl_count: float | None = None
    # Its ReplicaSet: pods of one template share a pace, and only they do.
    replica_set: str = ""


@dataclass(frozen=True)
class GatewayLoad:
    """The gateways' counts for this service, summed over gateway replicas."""

    in_flight: float = 0.0
    held: float = 0.0
    error: str | None = None
    # The mean time a request has lately held a pod's slot (None: none has yet).
    slot_seconds: float | None = None
    # Each gateway replica's count of the requests that have asked the service's pods for a
    # slot so far, by replica (None: not known).
    arrivals: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Observation:
    time: float
    # The replica count the Deployments are set to now, and how many pods are ready.
    current_replicas: int
    ready_replicas: int
    pods: Sequence[PodLoad] = ()
    # None when no gateway fronts the service.
    gateway: GatewayLoad | None = None
    # How long the service's latest pods took from creation to ready (None: none started yet).
    start_seconds: float | None = None


def _bad(value: float) -> bool:
    return not math.isfinite(value) or value < 0


def problems(obs: Observation) -> list[str]:
    """What the tick could not read, each named: the decision holds the count on any."""
    found = []
    for pod in obs.pods:
        if pod.error is not None:
            found.append(f"pod {pod.name}: {pod.error}")
        elif not valid(pod):
            found.append(
                f"pod {pod.name}: nonsensical values (running {pod.running}, waiting "
                f"{pod.waiting}, KV usage {pod.kv_usage})"
            )
    if len(obs.pods) < obs.ready_replicas:
        found.append(f"{obs.ready_replicas - len(obs.pods)} ready pods were not scraped")
    gateway = obs.gateway
    if gateway is not None:
        if gateway.error is not None:
            found.append(f"gateway: {gateway.error}")
        elif not readable(gateway):
            found.append(
                f"gateway: nonsensical values (in flight {gateway.in_flight}, held {gateway.held})"
            )
    return found


def valid(pod: PodLoad) -> bool:
    return pod.error is None and not (
        _bad(pod.running) or _bad(pod.waiting) or _bad(pod.kv_usage) or pod.kv_usage > 1.0
    )


def demand(
    obs: Observation, target: float | None, lines: Mapping[str, tuple[float, float]]
) -> tuple[float, float, float]:
    """(demand in flight, KV usage sum, the pace's scale) from the valid parts of an
    observation.

    A pod whose ReplicaSet has a pace line has its running count taken at the target's pace.
    A pod with a queue is full: its batch says what it can serve, not what comes, so it counts
    as it is. The gateway's in-flight count (the same requests, and those on their way) is
    scaled as the pods' total was, by the returned scale."""
    pods = [p for p in obs.pods if valid(p)]
    raw = sum(p.running + p.waiting for p in pods)
    demand = raw
    if target is not None:
        demand = sum(_worth(p, target, lines.get(p.replica_set)) for p in pods)
    kv = sum(p.kv_usage for p in pods)
    scale = demand / raw if raw else 1.0
    gateway = obs.gateway
    if readable(gateway):
        demand = max(demand, gateway.in_flight * scale)
    return demand, kv, scale


def readable(gateway: GatewayLoad | None) -> TypeGuard[GatewayLoad]:
    return (
        gateway is not None
        and gateway.error is None
        and not (_bad(gateway.in_flight) or _bad(gateway.held))
    )


def held_demand(
    gateway: GatewayLoad,
    held: Sequence[tuple[float, float]],
    scale: float,
    start_seconds: float | None,
) -> float:
    """The concurrency that the requests held at the gateway stand for.

    Held requests are not concurrency: a backlog of hundreds, behind saturated pods, would ask
    for as many slots, twice a burst's peak in the simulator. By Little's law what they ask for
    is a rate times the time a request holds a slot (``slot_seconds``, at the target's pace by
    ``scale``): the queue's growth is the arrivals the pods cannot take, and the backlog itself
    is work to finish within a few pod starts (``BACKLOG_STARTS``), as new replicas can take it
    no sooner than one. Until the gateway has timed a request, or while no pod has started,
    each held request counts as one.
    """
    if gateway.slot_seconds is None or _bad(gateway.slot_seconds) or not start_seconds:
        return gateway.held
    growth = max(0.0, load_window.slope(held)) if len(held) > 1 else 0.0
    return gateway.slot_seconds * scale * (growth + gateway.held / (BACKLOG_STARTS * start_seconds))


def arrivals_so_far(
    total: float, before: Mapping[str, float], counts: Mapping[str, float]
) -> float:
    """The gateways' arrivals as one count that only rises: ``total`` plus each replica's
    increase since its count ``before`` (Prometheus' ``increase`` per series, then ``sum``). A
    replica whose count went down restarted, and one not seen before is new: all they count
    is new. One that is gone drops out and keeps what it added. A plain sum of the counts
    falls with a restart, or reads a replica's restart as a lull beside the others' growth."""
    for replica, count in counts.items():
        last = before.get(replica)
        total += count - last if last is not None and count >= last else count
    return total


def arrivals(
    earlier: tuple[tuple[float, float], ...],
    counts: Mapping[str, float],
    gateway: GatewayLoad | None,
    now: float,
    scale: float,
    target: float | None,
) -> tuple[tuple[tuple[float, float], ...], Mapping[str, float], float | None]:
    """The arrival samples and counts to keep (after the ``earlier`` samples and each replica's
    last count in ``counts``), and the load's growth they show in replicas' worth a second (at
    the target's pace, by ``scale``), or None where the gateway does not count arrivals, has
    not timed a slot, or only a KV-cache target is set. Without counts (no gateway, or one that
    is not a number) the samples start afresh; a tick that could not read the gateway decides
    nothing and keeps them."""
    if (
        not readable(gateway)
        or gateway.arrivals is None
        or any(map(_bad, gateway.arrivals.values()))
    ):
        return (), {}, None
    total = arrivals_so_far(earlier[-1][1] if earlier else 0.0, counts, gateway.arrivals)
    kept = (a for a in earlier if a[0] > now - load_window.ARRIVAL_TREND)
    samples = (*kept, (now, total))
    if target is None or not gateway.slot_seconds or _bad(gateway.slot_seconds):
        return samples, gateway.arrivals, None
    growth = load_window.arrival_growth(samples, gateway.slot_seconds)
    return samples, gateway.arrivals, None if growth is None else growth * scale / target


def _worth(pod: PodLoad, target: float, line: tuple[float, float] | None) -> float:
    if line is None or pod.waiting:
        return pod.running + pod.waiting
    return at_target(pod.running, target, line)
