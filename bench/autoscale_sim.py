#!/usr/bin/env python3
"""Autoscaling by simulation: Ladle's policy against the anchors' on the same traffic.

A queueing simulator of model replicas replays each trace's requests (the same requests, from
the same seed, for every policy) and runs each policy on what it would observe:

- **ladle**: ``ladle.operator.scaling.decide``, the operator's own code, every 2 s on the pods'
  running/waiting counts and inter-token histogram totals (from which it learns their pace),
  the gateway's in-flight and held counts, its count of arrivals and its moving average of the
  time a request holds a slot, and the latest replica's start time (creation to ready, as the
  operator reads it from pod status), starting from the state the operator's loop starts from
  on a running service (``resumed``); scales to zero.
- **hpa**: the Kubernetes HPA's average-utilisation rule on per-pod concurrency every 15 s:
  ``ceil(ready * average / target)`` with its 10% tolerance, scale-up limited to
  max(100%, 4 pods) per period, and the 300 s scale-down stabilisation; minReplicas 1 (an HPA
  cannot scale to zero).
- **kubeai**: KubeAI's moving average of in-flight requests over 10 min at 10 s ticks,
  ``ceil(average / target)``, a 30 s scale-down delay as consecutive lower decisions, and
  its proxy's immediate 0 → 1 on a request for a model at zero.
- **fixed** (a reference, not a target): a fleet sized for the trace's peak, never scaled.
- **instant** (a reference, not a contender): every 2 s it sizes the fleet to the trace's true
  arrival rate at that moment, at the target, with no measurement, window or lag, but no
  foresight either. Its wait is what pod start alone costs a reactive policy.
- **instant+25%** (a reference too): the same with a quarter more replicas than the load needs,
  standing headroom that a burst can rise into while new pods start.

Targets: on every trace Ladle is at or below both hpa and kubeai, on GPU-hours and on p99
wait; on the bursts and to zero and back, its p99 wait is at most 1.5x instant's, at no more
than 1.1x instant's GPU-hours.

The replica model: each replica runs up to ``kv_capacity`` sequences at once; a request's first
token takes ``ttft(batch)``, each later one ``tpot(batch)``, both
interpolated from a measured profile (``--profile``: JSON with ``concurrency``, ``ttft_s`` and
``tpot_s`` lists, e.g. from ``ladle bench serve`` runs at those concurrencies). New replicas
serve after ``start_delay`` seconds; removed ones finish their requests first. A request that
waits longer than ``--timeout`` is dropped. GPU-hours count every replica from its creation to
its exit, starting and draining included.

Binding is late, as Ladle's gateway does it (``spec.routing.maxConcurrency``): a request waits
at the gateway until a ready replica has a free sequence slot, and goes to whichever frees one
first; every policy is measured so. The gateway's count of held requests is what policies that
read the gateway see. ``--binding early`` sends each request to the least-loaded ready replica
on arrival, to queue there, as before late binding.

Traffic is in units of one replica's throughput at the target concurrency, so the traces keep
their shape with any profile. Each (trace, policy) runs for several seeds; the table shows the
median and, in brackets, the range.

Run: .venv/bin/python bench/autoscale_sim.py [--seeds 5] [--profile FILE] [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ladle.operator.load import GatewayLoad, Observation, PodLoad
from ladle.operator.scaling import (
    ScalerState,
    ScalingPolicy,
    decide,
    resumed,
)

STEP = 0.1  # seconds of simulated time per step
SLOT_EWMA = 0.05  # the gateway's weight of each finished request in its mean slot time
INSTANT = "instant"
# The second reference's standing headroom.
HEADROOM = 1.25
# Against the lag-free reference, on the traces where pod start decides the wait.
INSTANT_TRACES = ("bursts", "to-zero-and-back")
INSTANT_WAIT = 1.5
INSTANT_COST = 1.1


@dataclass(frozen=True)
class Profile:
    """One replica's latency as a function of its batch size."""

    concurrency: tuple[float, ...]
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    kv_capacity: int = 64
    start_delay: float = 30.0
    output_tokens: int = 128
    # The concurrency per replica that meets the latency goal: every policy's target.
    target_concurrency: float = 32.0

    def _interp(self, ys: Sequence[float], batch: float) -> float:
        xs = self.concurrency
        if batch <= xs[0]:
            return ys[0]
        if batch >= xs[-1]:
            return ys[-1] * batch / xs[-1]  # past the measured range, per-token time grows
        i = bisect.bisect_right(xs, batch)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)

    def ttft(self, batch: float) -> float:
        return self._interp(self.ttft_s, batch)

    def tpot(self, batch: float) -> float:
        return self._interp(self.tpot_s, batch)

    def service_time(self, batch: float) -> float:
        return self.ttft(batch) + (self.output_tokens - 1) * self.tpot(batch)


# An 8B model on one H100-class GPU, in the range public vLLM benchmarks report (no GPU was
# at hand to measure one): TPOT grows slowly with the batch until compute binds. Pass measured
# numbers with --profile.
DEFAULT_PROFILE = Profile(
    concurrency=(1, 16, 64, 128),
    ttft_s=(0.03, 0.08, 0.2, 0.4),
    tpot_s=(0.007, 0.009, 0.014, 0.022),
    kv_capacity=128,
    start_delay=30.0,
    output_tokens=256,
    target_concurrency=64.0,
)


# -- traces: load in replicas' worth of traffic, as a function of time -----------------------


@dataclass(frozen=True)
class Trace:
    name: str
    duration: float
    load: Callable[[float], float]  # replicas' worth of arrivals at time t
    description: str


def _diurnal(t: float) -> float:
    return 1.0 + 9.0 * (1 - math.cos(2 * math.pi * t / 7200.0)) / 2


def _bursts(t: float) -> float:
    """Every 15 min: a 60 s ramp from 2 to 6, 3 min at 6, 60 s back down."""
    phase = t % 900.0 - 600.0
    if phase < 0:
        return 2.0
    if phase < 60.0:
        return 2.0 + 4.0 * phase / 60.0
    if phase < 240.0:
        return 6.0
    return max(2.0, 6.0 - 4.0 * (phase - 240.0) / 60.0)


def _to_zero_and_back(t: float) -> float:
    return 0.0 if 900 <= t < 2700 else 3.0


TRACES = (
    Trace("diurnal", 7200.0, _diurnal, "a day squeezed into 2 h: 1 → 10 → 1 replicas' worth"),
    Trace(
        "bursts",
        3600.0,
        _bursts,
        "2 replicas' worth; every 15 min a 1 min ramp to 6, 3 min there, 1 min back",
    ),
    Trace(
        "to-zero-and-back",
        3600.0,
        _to_zero_and_back,
        "3 replicas' worth; at 15 min it drops to nothing, and at 45 min it is back at once",
    ),
)


def arrivals(trace: Trace, rate_per_replica: float, seed: int) -> list[float]:
    """A non-homogeneous Poisson process, by thinning."""
    rng = random.Random(seed)
    peak = max(trace.load(t) for t in range(int(trace.duration))) * rate_per_replica
    times: list[float] = []
    t = 0.0
    if peak <= 0:
        return times
    while True:
        t += rng.expovariate(peak)
        if t >= trace.duration:
            return times
        if rng.random() * peak < trace.load(t) * rate_per_replica:
            times.append(t)


# -- the cluster -----------------------------------------------------------------------------


@dataclass
class Replica:
    name: str  # as a pod's, unique in a run
    created_at: float
    ready_at: float
    draining: bool = False
    # The replica's token clock: how many tokens each running sequence has had time to make.
    clock: float = 0.0
    # (clock value at which the sequence finishes, request index, admitted at, its TTFT)
    finishing: list[tuple[float, int, float, float]] = field(default_factory=list)
    waiting: deque[int] = field(default_factory=deque)
    # ``ladle:inter_token_latency_seconds``'s sum and count: every running sequence makes a
    # token each ``tpot(batch)``.
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    @property
    def running(self) -> int:
        return len(self.finishing)


@dataclass(frozen=True)
class View:
    """What a policy sees at a tick."""

    time: float
    replicas: int  # the current target
    ready: tuple[Replica, ...]
    held: int  # requests waiting at the gateway: for a free slot, or for a ready replica
    in_flight: int  # requests the gateway has sent to replicas (held ones are not in flight)
    # The gateway's moving average of the time a request holds a slot (None: none finished).
    slot_seconds: float | None
    # The latest ready replica's time from creation to ready (None: none yet).
    start_seconds: float | None
    # Requests that have reached the gateway so far.
    arrivals: int


class Policy(Protocol):
    name: str
    interval: float
    min_replicas: int

    def decide(self, view: View) -> int: ...


@dataclass
class Result:
    gpu_hours: float
    p99_wait: float  # arrival to admission into a batch, s; a drop counts as the timeout
    p99_ttft: float  # the wait plus prefill at the batch it joined, s
    mean_tpot: float  # seconds per output token after the first, over served requests
    dropped: int
    served: int
    scale_events: int


def simulate(
    trace: Trace,
    policy: Policy,
    profile: Profile,
    requests: Sequence[float],
    timeout: float,
    initial: int,
    late: bool = True,
) -> Result:
    """Run one policy over one trace's requests; deterministic for given inputs."""
    serials = itertools.count()
    replicas: list[Replica] = [Replica(f"r{next(serials)}", 0.0, 0.0) for _ in range(initial)]
    slot_seconds: float | None = None
    started: Replica | None = None
    target = initial
    gateway: deque[int] = deque()  # requests held at the gateway
    waits: list[float] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    dropped = 0
    scale_events = 0
    gpu_seconds = 0.0
    next_arrival = 0
    next_tick = 0.0
    now = 0.0
    end = trace.duration + 600.0  # let the last requests finish
    while now < end:
        ready = [r for r in replicas if r.ready(now)]
        while next_arrival < len(requests) and requests[next_arrival] <= now:
            gateway.append(next_arrival)
            next_arrival += 1
        while gateway and ready:
            least = min(ready, key=lambda r: r.running + len(r.waiting))
            if late and least.running + len(least.waiting) >= profile.kv_capacity:
                break  # no free slot anywhere: the request waits at the gateway
            least.waiting.append(gateway.popleft())
        # Requests that waited too long are dropped, wherever they wait.
        for queue in [gateway, *(r.waiting for r in replicas)]:
            while queue and now - requests[queue[0]] > timeout:
                queue.popleft()
                dropped += 1
        for r in replicas:
            if now < r.ready_at:
                continue
            while r.waiting and r.running < profile.kv_capacity:
                index = r.waiting.popleft()
                wait = now - requests[index]
                batch = r.running + 1
                ttft = profile.ttft(batch)
                waits.append(wait)
                ttfts.append(wait + ttft)
                # The first token after ttft, in the token clock's units at this batch.
                tokens = ttft / profile.tpot(batch) + profile.output_tokens - 1
                heapq.heappush(r.finishing, (r.clock + tokens, index, now, ttft))
            if r.finishing:
                tpot = profile.tpot(r.running)
                r.clock += STEP / tpot
                r.itl_count += r.running * STEP / tpot
                r.itl_sum += r.running * STEP
                while r.finishing and r.finishing[0][0] <= r.clock:
                    _, _, admitted, ttft = heapq.heappop(r.finishing)
                    tpots.append((now - admitted - ttft) / (profile.output_tokens - 1))
                    slot = now - admitted
                    slot_seconds = (
                        slot
                        if slot_seconds is None
                        else slot_seconds + SLOT_EWMA * (slot - slot_seconds)
                    )
        # Draining replicas leave once empty (their queue was handed back when they drained).
        replicas = [r for r in replicas if not (r.draining and not r.finishing)]
        gpu_seconds += STEP * len(replicas)

        if now >= next_tick:
            next_tick += policy.interval
            ready = [r for r in replicas if r.ready(now)]
            in_flight = sum(r.running + len(r.waiting) for r in replicas)
            started = max(ready, key=lambda r: r.ready_at, default=started)
            start_seconds = None if started is None else started.ready_at - started.created_at
            view = View(
                now,
                target,
                tuple(ready),
                len(gateway),
                in_flight,
                slot_seconds,
                start_seconds,
                next_arrival,
            )
            wanted = policy.decide(view)
            if wanted != target:
                scale_events += 1
                target = wanted
            live = [r for r in replicas if not r.draining]
            for _ in range(target - len(live)):
                replicas.append(Replica(f"r{next(serials)}", now, now + profile.start_delay))
            if len(live) > target:
                # Starting replicas go first, then the least busy.
                live.sort(key=lambda r: (r.ready_at <= now, r.running + len(r.waiting)))
                for r in live[: len(live) - target]:
                    r.draining = True
                    gateway.extend(sorted(r.waiting))
                    r.waiting.clear()
        now += STEP
    dropped += len(gateway) + sum(len(r.waiting) for r in replicas)
    drops = [timeout] * dropped
    return Result(
        gpu_hours=gpu_seconds / 3600.0,
        p99_wait=_percentile(waits + drops, 99.0),
        p99_ttft=_percentile(ttfts + drops, 99.0),
        mean_tpot=statistics.fmean(tpots) if tpots else 0.0,
        dropped=dropped,
        served=len(waits),
        scale_events=scale_events,
    )


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


# -- the policies ----------------------------------------------------------------------------


class LadlePolicy:
    interval = 2.0

    def __init__(self, name: str, policy: ScalingPolicy, capacity: int) -> None:
        self.name = name
        self.policy = policy
        self.min_replicas = policy.min_replicas
        self.capacity = capacity
        self.state: ScalerState | None = None

    def decide(self, view: View) -> int:
        if self.state is None:
            # As the operator's loop does when it takes over a running service.
            self.state = resumed(view.time, view.replicas, self.policy)
        pods = tuple(
            PodLoad(
                r.name,
                running=r.running,
                waiting=len(r.waiting),
                kv_usage=min(1.0, r.running / self.capacity),
                itl_sum=r.itl_sum,
                itl_count=r.itl_count,
            )
            for r in view.ready
        )
        obs = Observation(
            time=view.time,
            current_replicas=view.replicas,
            ready_replicas=len(view.ready),
            pods=pods,
            gateway=GatewayLoad(
                in_flight=view.in_flight,
                held=view.held,
                slot_seconds=view.slot_seconds,
                arrivals={"gateway": view.arrivals},
            ),
            start_seconds=view.start_seconds,
        )
        decision, self.state = decide(self.policy, self.state, obs)
        return decision.replicas


class HpaPolicy:
    """kube-controller-manager's HPA algorithm on an average-value metric that reaches it
    through Prometheus and an adapter: scraped every 15 s and ``metrics_lag`` seconds old when
    the HPA reads it (scrape interval plus the adapter's rate window)."""

    name = "hpa"
    interval = 5.0  # the simulator's sampling; the HPA itself syncs every 15 s
    sync = 15.0
    min_replicas = 1
    tolerance = 0.1
    stabilization = 300.0

    def __init__(self, target: float, max_replicas: int, metrics_lag: float) -> None:
        self.target = target
        self.max_replicas = max_replicas
        self.metrics_lag = metrics_lag
        self.recommendations: deque[tuple[float, int]] = deque()
        self.scrapes: deque[tuple[float, float | None]] = deque()  # (time, per-pod average)
        self.next_sync = 0.0
        self.replicas = 0

    def decide(self, view: View) -> int:
        average = (
            sum(r.running + len(r.waiting) for r in view.ready) / len(view.ready)
            if view.ready
            else None
        )
        self.scrapes.append((view.time, average))
        if view.time < self.next_sync:
            return view.replicas
        self.next_sync = view.time + self.sync
        while len(self.scrapes) > 1 and self.scrapes[1][0] <= view.time - self.metrics_lag:
            self.scrapes.popleft()
        seen = self.scrapes[0][1]
        if seen is None or not view.ready:
            return max(view.replicas, self.min_replicas)
        ratio = seen / self.target
        if abs(ratio - 1.0) <= self.tolerance:
            wanted = view.replicas
        else:
            wanted = math.ceil(len(view.ready) * ratio)
        wanted = max(self.min_replicas, min(wanted, self.max_replicas))
        self.recommendations.append((view.time, wanted))
        while self.recommendations[0][0] < view.time - self.stabilization:
            self.recommendations.popleft()
        if wanted < view.replicas:  # scale down only to the highest recent recommendation
            wanted = min(view.replicas, max(w for _, w in self.recommendations))
        limit = max(2 * view.replicas, view.replicas + 4)
        return min(wanted, limit)


class KubeAIPolicy:
    name = "kubeai"
    interval = 10.0
    window = 600.0
    scale_down_delay = 30.0

    def __init__(self, target: float, min_replicas: int, max_replicas: int) -> None:
        self.target = target
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.samples: deque[float] = deque(maxlen=int(self.window / self.interval))
        self.lower_since: float | None = None

    def decide(self, view: View) -> int:
        self.samples.append(view.in_flight + view.held)  # its proxy counts what it holds
        average = sum(self.samples) / len(self.samples)
        wanted = max(self.min_replicas, min(self.max_replicas, math.ceil(average / self.target)))
        if view.held and view.replicas == 0:
            wanted = max(wanted, 1)  # the proxy scales a model at zero up on a request
        if wanted >= view.replicas:
            self.lower_since = None
            return wanted
        if self.lower_since is None:
            self.lower_since = view.time
        if view.time - self.lower_since >= self.scale_down_delay:
            self.lower_since = None
            return wanted
        return view.replicas


class FixedPolicy:
    name = "fixed"
    interval = 60.0
    min_replicas = 0

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, view: View) -> int:
        return self.replicas


def _instant_name(headroom: float) -> str:
    return INSTANT if headroom == 1.0 else f"{INSTANT}+{headroom - 1:.0%}"


class InstantPolicy:
    """A reference: the fleet sized to the trace's true load every 2 s, times ``headroom``."""

    interval = 2.0
    min_replicas = 1

    def __init__(self, trace: Trace, max_replicas: int, headroom: float = 1.0) -> None:
        self.trace = trace
        self.max_replicas = max_replicas
        self.headroom = headroom
        self.name = _instant_name(headroom)

    def decide(self, view: View) -> int:
        wanted = math.ceil(self.headroom * self.trace.load(view.time) - 1e-9)
        return max(self.min_replicas, min(wanted, self.max_replicas))


# -- the report ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, dict[str, list[Result]]]:
    profile = DEFAULT_PROFILE
    if args.profile:
        data = json.loads(Path(args.profile).read_text())
        profile = Profile(
            tuple(data["concurrency"]),
            tuple(data["ttft_s"]),
            tuple(data["tpot_s"]),
            int(data.get("kv_capacity", profile.kv_capacity)),
            float(data.get("start_delay", profile.start_delay)),
            int(data.get("output_tokens", profile.output_tokens)),
            float(data.get("target_concurrency", profile.target_concurrency)),
        )
    target = profile.target_concurrency
    rate = target / profile.service_time(target)  # requests/s one replica serves at target
    results: dict[str, dict[str, list[Result]]] = {}
    for trace in TRACES:
        peak = max(trace.load(t) for t in range(int(trace.duration)))
        max_replicas = math.ceil(peak * 2)
        for seed in range(args.seeds):
            requests = arrivals(trace, rate, seed)
            # Everyone keeps one replica (an HPA cannot go lower); "ladle-zero" shows what
            # scaling to zero saves and costs, outside the comparison.
            policies: list[Policy] = [
                LadlePolicy("ladle", ScalingPolicy(1, max_replicas, target), profile.kv_capacity),
                HpaPolicy(target, max_replicas, args.hpa_metrics_lag),
                KubeAIPolicy(target, 1, max_replicas),
                FixedPolicy(math.ceil(peak)),
                LadlePolicy(
                    "ladle-zero", ScalingPolicy(0, max_replicas, target), profile.kv_capacity
                ),
                InstantPolicy(trace, max_replicas),
                InstantPolicy(trace, max_replicas, HEADROOM),
            ]
            for policy in policies:
                initial = (
                    policy.replicas
                    if isinstance(policy, FixedPolicy)
                    else max(policy.min_replicas, math.ceil(trace.load(0.0)))
                )
                result = simulate(
                    trace, policy, profile, requests, args.timeout, initial, args.binding == "late"
                )
                results.setdefault(trace.name, {}).setdefault(policy.name, []).append(result)
    return results


def _cell(values: Sequence[float], fmt: str) -> str:
    mid = statistics.median(values)
    if min(values) == max(values):
        return format(mid, fmt)
    return f"{format(mid, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def _no_worse(ours: float, theirs: float, slack: float) -> bool:
    return ours <= theirs + slack


Medians = dict[str, tuple[float, float]]  # policy: (GPU-hours, p99 queue wait)


def _medians(rows: dict[str, list[Result]]) -> Medians:
    return {
        name: (
            statistics.median(r.gpu_hours for r in runs),
            statistics.median(r.p99_wait for r in runs),
        )
        for name, runs in rows.items()
    }


def report(results: dict[str, dict[str, list[Result]]]) -> bool:
    """Print one Markdown table per trace and the targets; True when every target holds.

    Medians over seeds are compared. Queue waits within one simulation step, and GPU-hours
    within 0.5%, count as equal."""
    ok = True
    for trace in TRACES:
        rows = results[trace.name]
        print(f"\n**{trace.name}**: {trace.description}\n")
        print(
            "| policy | GPU-hours | p99 queue wait (s) | dropped | scale events "
            "| p99 TTFT (s) | mean TPOT (ms) |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, runs in rows.items():
            print(
                f"| {name} | {_cell([r.gpu_hours for r in runs], '.2f')} "
                f"| {_cell([r.p99_wait for r in runs], '.1f')} "
                f"| {_cell([r.dropped for r in runs], '.0f')} "
                f"| {_cell([r.scale_events for r in runs], '.0f')} "
                f"| {_cell([r.p99_ttft for r in runs], '.1f')} "
                f"| {_cell([1000 * r.mean_tpot for r in runs], '.1f')} |"
            )
        median = _medians(rows)
        cost, wait = median["ladle"]
        checks = []
        for name in ("hpa", "kubeai"):
            their_cost, their_wait = median[name]
            checks.append(
                (
                    f"at or below {name} on GPU-hours ({cost:.2f} vs {their_cost:.2f}) and on "
                    f"p99 wait ({wait:.1f} vs {their_wait:.1f} s)",
                    _no_worse(cost, their_cost, 0.005 * their_cost)
                    and _no_worse(wait, their_wait, STEP),
                )
            )
        if trace.name in INSTANT_TRACES:
            ref_cost, ref_wait = median[INSTANT]
            checks.append(
                (
                    f"p99 wait at most {INSTANT_WAIT}x instant's ({wait:.1f} vs "
                    f"{ref_wait:.1f} s: {wait / max(ref_wait, STEP):.2f}x) at no more than "
                    f"{INSTANT_COST}x its GPU-hours ({cost:.2f} vs {ref_cost:.2f}: "
                    f"{cost / ref_cost:.2f}x)",
                    _no_worse(wait, INSTANT_WAIT * ref_wait, STEP)
                    and cost <= INSTANT_COST * ref_cost,
                )
            )
        for what, passed in checks:
            print(f"- {'PASS' if passed else 'FAIL'}: {what}")
            ok = ok and passed
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="arrival seeds per trace")
    parser.add_argument("--timeout", type=float, default=60.0, help="queue wait before a drop, s")
    parser.add_argument(
        "--hpa-metrics-lag",
        type=float,
        default=30.0,
        help="age of the metric the HPA reads (Prometheus scrape + adapter), s",
    )
    parser.add_argument("--profile", help="JSON replica profile (see the module docstring)")
    parser.add_argument(
        "--binding",
        choices=("late", "early"),
        default="late",
        help="late: requests wait at the gateway for a free slot; early: in the replicas",
    )
    parser.add_argument("--json", help="also write the per-seed results here")
    args = parser.parse_args(argv)
    results = run(args)
    ok = report(results)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    t: {p: [vars(r) for r in rs] for p, rs in ps.items()}
                    for t, ps in results.items()
                },
                indent=2,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
