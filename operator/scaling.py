"""Replica decisions from LLM load signals, in the shape of Knative's KPA.

A decision is a pure function of the policy, what the scaler remembers (its sliding window,
its panic state, recent decisions) and one tick's observation. The operator's scaling loop and
the simulator in ``bench/autoscale_sim.py`` run exactly this code, so what the benchmark
measures is what the cluster does.

Demand is the number of requests that want a replica (read by ``ladle.operator.load``): what the
runtime pods run and queue (``ladle:num_requests_running`` + ``ladle:num_requests_waiting``),
or the gateway's in-flight count when that is larger (requests on their way to a pod), plus
what the requests the gateway holds ask for. A target per replica turns demand into replicas;
with a KV-cache target too, the larger answer wins. Once the scaler has learned how a
ReplicaSet's pods slow with their batch (``pace``), their running requests are counted at the
target's pace: a crowded pod's requests are slow, not more traffic.

These rules come from the field's failures rather than from Knative:

- Unknown data never scales down. A failed scrape, a stale sample, NaN or a negative value is not
  zero load (knative#8610, kubeai#67): the decision holds the current count, says why, and may
  only rise on what the valid pods alone prove.
- A request the gateway holds for a service at zero starts a replica at once, whatever the
  windows say.
- Scale-down waits for the larger of the decisions over ``scale_down_delay``, and for the
  scale-to-zero grace period without any demand.
- A rise in the panic window that is past the current count's tolerance, 20% above the load
  before it and three standard deviations beyond that load's noise scales up at once (reason
  ``Rising``), before the stable mean or the 2x panic threshold shows it, to what its trend
  projects over the pods' measured start time; only the stable window scales down.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ladle.operator import load, load_window
from ladle.operator.load import Observation
from ladle.operator.pace import Paces
from ladle.words import plural

# Reasons, as status and Events show them.
STABLE = "Stable"
RISING = "Rising"
PANIC = "Panic"
SCALED_TO_ZERO = "ScaledToZero"
IDLE = "IdleGracePeriod"
ACTIVATING = "Activating"
METRICS_UNAVAILABLE = "MetricsUnavailable"
AT_MAX = "AtMaxReplicas"
# Outside panic, the count moves only once demand leaves a band this wide around the current
# replicas' targets (HPA's tolerance); a load hovering at a replica boundary would otherwise
# step the count up and down with every bit of noise.
TOLERANCE = 0.1
# Coming down, a count at the target's pace settles on the replicas that hold its load, noise
# included, within this much above their targets. Without it a load of exactly N replicas'
# worth (the simulated bursts' base) reads a hair above N and keeps N + 1 for as long as it
# lasts; the way back up needs TOLERANCE, so a band of 7% plus the noise is left between.
SETTLE = 0.03


@dataclass(frozen=True)
class ScalingPolicy:
    """``spec.autoscaling`` with the replica bounds; durations in seconds."""

    min_replicas: int = 1
    max_replicas: int = 10
    # Demand per replica; None leaves that signal out (at least one target is set).
    target_concurrency: float | None = 16.0
    target_kv_usage: float | None = None
    stable_window: float = 60.0
    panic_window_percent: float = 10.0
    # Panic starts when the panic-window demand needs this many times the ready replicas.
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_down_delay: float = 30.0
    scale_to_zero_grace: float = 30.0

    def __post_init__(self) -> None:
        if self.target_concurrency is None and self.target_kv_usage is None:
            raise ValueError("a scaling policy needs targetConcurrency or targetKVCacheUsage")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= minReplicas <= maxReplicas")

    @property
    def panic_window(self) -> float:
        return self.stable_window * self.panic_window_percent / 100.0


@dataclass(frozen=True)
class ScalerState:
    """What the scaler remembers between ticks; the operator keeps one per service."""

    # (time, demand, KV usage summed over pods), oldest first, within the stable window.
    window: tuple[tuple[float, float, float], ...] = ()
    panic_since: float | None = None
    max_panic_replicas: int = 0
    # (time, decision) within the scale-down delay.
    recent: tuple[tuple[float, int], ...] = ()
    # The last tick with any demand; None until the first tick.
    last_active: float | None = None
    # (until, replicas): no decision below this count before then.
    floor: tuple[float, int] | None = None
    paces: Paces = field(default_factory=Paces)
    # (time, requests held at the gateway) within the panic window, for the queue's growth.
    held: tuple[tuple[float, float], ...] = ()
    # The last pod start time seen: a service at zero has no pod to show one.
    start_seconds: float | None = None
    # (time, the gateways' arrivals so far) within ``load_window.ARRIVAL_TREND``, and each
    # replica's count at the last of them.
    arrivals: tuple[tuple[float, float], ...] = ()
    arrival_counts: Mapping[str, float] = field(default_factory=dict)


def resumed(now: float, replicas: int, policy: ScalingPolicy) -> ScalerState:
    """The state to start from when the scaler takes over a running service (a new leader,
    autoscaling just switched on): with no history yet, an empty window would read as no load,
    so it stays at or above the current count for one stable window (Knative starts such
    scalers in panic mode for the same reason)."""
    if replicas <= 1:
        return ScalerState()
    return ScalerState(floor=(now + policy.stable_window, replicas))


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    message: str
    panicking: bool = False
    # True while some or all metrics are unknown: the count may hold or rise, never fall.
    frozen: bool = False
    stable_demand: float = 0.0
    panic_demand: float = 0.0
    # Whether demand is counted at the target's pace (``pace``) rather than as it runs.
    paced: bool = False
    # What the signals asked for before maxReplicas capped it.
    wanted: int = field(default=0)


def load_in_replicas(policy: ScalingPolicy, demand: float, kv_usage: float) -> float:
    """Demand in replicas' worth at the targets; with both targets the larger wins."""
    replicas = 0.0
    if policy.target_concurrency is not None:
        replicas = demand / policy.target_concurrency
    if policy.target_kv_usage is not None:
        replicas = max(replicas, kv_usage / policy.target_kv_usage)
    return replicas


def replicas_for(policy: ScalingPolicy, demand: float, kv_usage: float) -> int:
    """Replicas that bring demand per replica down to the targets."""
    return math.ceil(load_in_replicas(policy, demand, kv_usage))


def _with_tolerance(
    policy: ScalingPolicy, demand: float, kv: float, current: int, noise: float | None
) -> int:
    """The count for a stable demand, moved only once it leaves the tolerance band.

    Coming down, a count taken as it runs keeps the band as headroom: pods below the target
    are quicker than at it, so their count understates the traffic, and going straight to it
    undershoots and comes back (in the simulator, twice the scale events). A count at the
    target's pace (``noise`` given) has no such bias, and goes where it says, as the HPA does,
    but one standard error of the window's mean above it (without that, a steady load whose
    noise spans the band's 10% steps down and back up every few minutes), and within
    ``SETTLE`` of the targets."""
    wanted = replicas_for(policy, demand, kv)
    if wanted > current:
        up = 1.0 + TOLERANCE
        return max(current, replicas_for(policy, demand / up, kv / up))
    down = 1.0 - TOLERANCE
    if noise is not None:
        worth = load_in_replicas(policy, demand, kv)
        settled = math.ceil((worth + noise) / (1.0 + SETTLE))
        return min(current, settled) if worth < down * current else current
    if wanted < current:
        return min(current, replicas_for(policy, demand / down, kv / down))
    return wanted


def _mean(window: Sequence[tuple[float, float, float]], since: float) -> tuple[float, float]:
    recent = [(d, kv) for t, d, kv in window if t > since]
    if not recent:
        return 0.0, 0.0
    return sum(d for d, _ in recent) / len(recent), sum(kv for _, kv in recent) / len(recent)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def decide(
    policy: ScalingPolicy, state: ScalerState, obs: Observation
) -> tuple[Decision, ScalerState]:
    """One tick of the scaler: the replica count to run, and the state for the next tick."""
    now = obs.time
    problems = load.problems(obs)
    target = policy.target_concurrency
    paces = state.paces
    valid = [p for p in obs.pods if load.valid(p)]
    if target is not None:
        # An unreadable pod drops out of the pace's memory: when it is back, the gaps it
        # stalled for are not its pace.
        paces = paces.observe(now, obs.pods, target, valid)
    lines = paces.lines()
    # Paced only when every pod is: a pod still counted as it runs (a new canary's, before
    # its pace is known) keeps the headroom such counts need.
    paced = bool(lines) and all(p.replica_set in lines for p in valid)
    demand, kv, scale = load.demand(obs, target, lines)
    start_seconds = obs.start_seconds or state.start_seconds
    gateway = obs.gateway
    held = 0.0
    queue: tuple[tuple[float, float], ...] = ()
    if load.readable(gateway):
        held = gateway.held
        queue = (*(q for q in state.held if q[0] > now - policy.panic_window), (now, held))
        demand += load.held_demand(gateway, queue, scale, start_seconds)
    last_active = state.last_active if state.last_active is not None else now
    if demand > 0:
        last_active = now
    ready = max(1, obs.ready_replicas)
    max_up = math.ceil(policy.max_scale_up_rate * ready)
    max_down = math.floor(ready / policy.max_scale_down_rate)

    if problems:
        # Hold the count; rise only as far as the readable pods alone prove necessary.
        proven = min(replicas_for(policy, demand, kv), max_up)
        wanted = max(obs.current_replicas, proven)
        replicas = _clamp(wanted, policy.min_replicas, policy.max_replicas)
        decision = Decision(
            replicas,
            METRICS_UNAVAILABLE,
            "holding at the current count, metrics are unknown: " + "; ".join(problems),
            panicking=state.panic_since is not None,
            frozen=True,
            paced=paced,
            wanted=wanted,
        )
        return decision, replace(
            state, last_active=last_active, paces=paces, start_seconds=start_seconds
        )

    earlier = tuple(s for s in state.window if s[0] > now - policy.stable_window)
    window = (*earlier, (now, demand, kv))
    stable_demand, stable_kv = _mean(window, now - policy.stable_window)
    panic_demand, panic_kv = _mean(window, now - policy.panic_window)
    loads = [(t, load_in_replicas(policy, d, kv)) for t, d, kv in window]
    noise = load_window.noise([y for _, y in loads[:-1]]) if paced else None  # earlier ticks'
    stable_wanted = _with_tolerance(policy, stable_demand, stable_kv, obs.current_replicas, noise)
    panic_wanted = replicas_for(policy, panic_demand, panic_kv)
    arrivals, arrival_counts, growth = load.arrivals(
        state.arrivals, state.arrival_counts, gateway, now, scale, target
    )
    rising = load_window.rising(
        loads, now, policy.panic_window, TOLERANCE, obs.current_replicas, start_seconds, growth
    )
    stable_reason = RISING if rising > stable_wanted else STABLE
    stable_wanted = max(stable_wanted, rising)
    desired_stable = _clamp(stable_wanted, max_down, max_up)
    desired_panic = _clamp(panic_wanted, max_down, max_up)

    # Unrounded, unlike Knative's: one replica at 51% of its target must not read as a
    # doubling. With no pod ready, one counts, so a burst onto a service at zero panics at once.
    over = load_in_replicas(policy, panic_demand, panic_kv) / ready >= policy.panic_threshold
    panic_since = state.panic_since
    max_panic = state.max_panic_replicas
    if over:
        panic_since = now
    elif panic_since is not None and now - panic_since > policy.stable_window:
        panic_since, max_panic = None, 0
    if panic_since is not None:
        # Panic keeps its own highest count, not the stable window's: a projected rise
        # (``load_window.rising``) holds only while the trend does.
        max_panic = max(max_panic, desired_panic)
        desired = max(max_panic, desired_stable)
        reason = stable_reason if desired_stable > max_panic else PANIC
    else:
        desired, reason = desired_stable, stable_reason

    recent = (*(r for r in state.recent if r[0] > now - policy.scale_down_delay), (now, desired))
    desired = max(d for _, d in recent)
    floor = state.floor if state.floor is not None and now < state.floor[0] else None
    if floor is not None:
        desired = max(desired, floor[1])

    if held > 0 and desired < 1:
        desired, reason = 1, ACTIVATING
    if desired == 0:
        if now - last_active < policy.scale_to_zero_grace and obs.current_replicas > 0:
            desired, reason = 1, IDLE
        else:
            reason = SCALED_TO_ZERO

    wanted = desired
    replicas = _clamp(desired, policy.min_replicas, policy.max_replicas)
    if wanted > policy.max_replicas:
        reason = AT_MAX
    message = _message(policy, reason, replicas, wanted, stable_demand, panic_demand, held, paced)
    decision = Decision(
        replicas,
        reason,
        message,
        panicking=panic_since is not None,
        stable_demand=stable_demand,
        panic_demand=panic_demand,
        paced=paced,
        wanted=wanted,
    )
    state = ScalerState(
        window,
        panic_since,
        max_panic,
        recent,
        last_active,
        floor,
        paces,
        queue,
        start_seconds,
        arrivals,
        arrival_counts,
    )
    return decision, state


def _message(
    policy: ScalingPolicy,
    reason: str,
    replicas: int,
    wanted: int,
    stable: float,
    panic: float,
    held: float,
    paced: bool,
) -> str:
    if reason == ACTIVATING:
        waiting = plural(held, "request is", "requests are")
        return f"{waiting} held with no replica ready; starting one"
    if reason == SCALED_TO_ZERO:
        return f"no requests for {policy.scale_to_zero_grace:g} s; scaled to zero"
    if reason == IDLE:
        return f"no requests; scaling to zero after {policy.scale_to_zero_grace:g} s without any"
    if reason == PANIC:
        window = f"panic window ({policy.panic_window:g} s) demand {panic:.1f}"
    elif reason == RISING:
        window = (
            f"panic window ({policy.panic_window:g} s) demand {panic:.1f} rises past the noise "
            f"of the last {policy.stable_window:g} s"
        )
    else:
        window = f"demand {stable:.1f} over {policy.stable_window:g} s"
    if paced:
        window += " at the target's pace"
    targets = []
    if policy.target_concurrency is not None:
        targets.append(plural(policy.target_concurrency, "request"))
    if policy.target_kv_usage is not None:
        targets.append(f"{policy.target_kv_usage:g} KV-cache usage")
    target = "target " + " and ".join(targets) + " per replica"
    capped = f" (wants {wanted}, maxReplicas is {policy.max_replicas})" if reason == AT_MAX else ""
    return f"{window}, {target}: {plural(replicas, 'replica')}{capped}"
