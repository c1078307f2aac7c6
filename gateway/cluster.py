"""The cluster: what the router's decisions need between requests, kept per service and per pod.

Per service a circuit breaker (with its fallback), an outlier detector, a hash ring per variant
and the scale-from-zero hold queue; per pod the requests in flight. It is rebuilt from each new
route table, keeping the state of services that remain, and reports breaker transitions and
hold episodes through ``Hooks`` (the status writer subscribes there). Everything runs on one
event loop, so none of it needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ladle.gateway.breaker import Admission, CircuitBreaker, Transition
from ladle.gateway.context import Outcome
from ladle.gateway.errors import GatewayError
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.outlier import OutlierDetector
from ladle.gateway.picker import Candidate, HashRing, pick
from ladle.gateway.routes import Pod, RouteTable, Service, ServiceKey
from ladle.gateway.scrape import PodLoad
from ladle.gateway.split import choose_variant
from ladle.gateway.upstream import Pool
from ladle.words import plural

log = logging.getLogger("ladle.gateway")

MAX_FALLBACK_HOPS = 3
# Outcomes of an attempt that say nothing against the pod.
_POD_FINE = frozenset({"ok", "http_4xx", "client_deadline"})


class ServiceState:
    """The live routing state of one InferenceService."""

    def __init__(self, service: Service, now: float) -> None:
        self.service = service
        self.breaker = CircuitBreaker(service.breaker, now)
        self.outlier = OutlierDetector(service.outlier)
        self.ready: dict[str, list[Pod]] = {}
        self.rings: dict[str, HashRing] = {}
        self.pod_count = 0
        self.ready_event = asyncio.Event()
        self.held = 0
        self.held_since: float | None = None

    @property
    def key(self) -> ServiceKey:
        return self.service.key

    def configure(self, service: Service, now: float) -> None:
        old = self.service
        self.service = service
        if service.breaker != old.breaker:
            self.breaker = CircuitBreaker(service.breaker, now)
        if service.outlier != old.outlier:
            self.outlier = OutlierDetector(service.outlier)

    def set_pods(self, ready: dict[str, list[Pod]], all_pods: set[str]) -> None:
        self.ready = ready
        self.pod_count = sum(len(p) for p in ready.values())
        for variant, pods in ready.items():
            names = [p.id for p in pods]
            ring = self.rings.get(variant)
            if ring is None or ring.pods != frozenset(names):
                self.rings[variant] = HashRing(names)
        for variant in self.rings.keys() - ready.keys():
            del self.rings[variant]
        self.outlier.retain(all_pods)
        if self.pod_count:
            self.ready_event.set()
        else:
            self.ready_event.clear()


@dataclass
class Hooks:
    """Where breaker transitions and hold episodes are reported (status writer, logs)."""

    on_transition: Callable[[ServiceState, Transition], None] = lambda st, t: None
    on_hold: Callable[[ServiceState], None] = lambda st: None
    on_new: Callable[[ServiceState], None] = lambda st: None
    on_table: Callable[[RouteTable, Mapping[ServiceKey, ServiceState]], None] = lambda t, s: None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The service a request goes to once the breakers had their say."""

    state: ServiceState
    probe: bool  # the half-open breaker's one trial request
    fallback_from: str | None


@dataclass
class Cluster:
    metrics: GatewayMetrics
    pool: Pool
    max_held: int = 256
    hooks: Hooks = field(default_factory=Hooks)
    loads: Callable[[], dict[str, PodLoad]] = dict
    rng: random.Random = field(default_factory=random.Random)
    table: RouteTable = field(default_factory=RouteTable)
    states: dict[ServiceKey, ServiceState] = field(default_factory=dict)
    outstanding: dict[str, int] = field(default_factory=dict)

    # -- table updates and time ----------------------------------------------------------

    def update(self, table: RouteTable, now: float) -> None:
        old_pods = {
            p for variants in self.table.pods.values() for ps in variants.values() for p in ps
        }
        self.table = table
        for key in self.states.keys() - table.services.keys():
            self.states.pop(key)
            self.metrics.forget_service(*key)
        for key, service in table.services.items():
            state = self.states.get(key)
            if state is None:
                state = self.states[key] = ServiceState(service, now)
                self.metrics.breaker(*key, state.breaker.state)
                self.hooks.on_new(state)
            else:
                state.configure(service, now)
            all_pods = {p.id for ps in table.pods.get(key, {}).values() for p in ps}
            state.set_pods(table.ready_pods(key), all_pods)
        self.hooks.on_table(table, self.states)
        new_pods = {p for variants in table.pods.values() for ps in variants.values() for p in ps}
        addresses = {(p.host, p.port) for p in new_pods}
        ids = {p.id for p in new_pods}
        for gone in old_pods - new_pods:
            if (gone.host, gone.port) not in addresses:
                self.pool.drop(gone.host, gone.port)
            if gone.id not in ids:
                self.metrics.forget_pod(gone.id)
        self.tick(now)

    def tick(self, now: float) -> None:
        """Time-driven breaker transitions; called every second and after each update."""
        for state in self.states.values():
            expected = state.service.replicas > 0
            transition = state.breaker.observe_ready(now, state.pod_count, expected)
            if transition is not None:
                self._transitioned(state, transition)
            self.metrics.ejected.labels(*state.key).set(len(state.outlier.ejected(now)))

    def _transitioned(self, state: ServiceState, transition: Transition) -> None:
        ns, name = state.key
        self.metrics.breaker(ns, name, transition.new)
        self.metrics.breaker_transitions.labels(ns, name, transition.new.value).inc()
        log.warning(
            "circuit breaker %s",
            transition.new.value.lower(),
            extra={
                "namespace": ns,
                "service": name,
                "from": transition.old.value,
                "to": transition.new.value,
                "reason": transition.reason,
                "fallback": state.service.fallback,
            },
        )
        self.hooks.on_transition(state, transition)

    def models(self) -> list[Service]:
        return sorted(self.table.by_model.values(), key=lambda s: s.model)

    # -- the breaker and its fallback ------------------------------------------------------

    def admit(self, service: Service, now: float, out: Outcome) -> Admitted:
        """The service whose breaker lets the request through: ``service``'s own, else along
        its fallbacks; raises the 503 of the service that refused it when none does."""
        state = self.states[service.key]
        visited: list[ServiceState] = []
        while True:
            transition = state.breaker.tick(now)  # open → half-open happens as time passes
            if transition is not None:
                self._transitioned(state, transition)
            admission = state.breaker.allow(now)
            if admission is not Admission.REJECT:
                break
            fallback = state.service.fallback
            nxt = self.states.get((state.key[0], fallback)) if fallback else None
            if nxt is None or nxt in visited or nxt is state or len(visited) >= MAX_FALLBACK_HOPS:
                self.metrics.rejected.labels(*state.key, "breaker_open").inc()
                # Counted under the service that refused it: the availability SLO must see it.
                out.service = state.service
                wait = state.service.breaker.open_seconds - (now - state.breaker.since)
                retry = max(1, math.ceil(wait))
                raise GatewayError(
                    503,
                    f"{state.key[1]} is unavailable: its circuit breaker is open "
                    f"({state.breaker.reason}); retry in {retry} s",
                    "circuit_open",
                    headers=[(b"retry-after", str(retry).encode())],
                )
            self.metrics.fallbacks.labels(*state.key, nxt.key[1]).inc()
            visited.append(state)
            state = nxt
        out.service = state.service
        fallback_from = visited[0].key[1] if visited else None
        out.fallback_from = fallback_from
        return Admitted(state, admission is Admission.PROBE, fallback_from)

    def finish(self, admitted: Admitted, success: bool | None, now: float) -> None:
        """The breaker's verdict on a request: None when it says nothing about the service."""
        state = admitted.state
        if success is None:
            if admitted.probe:
                state.breaker.release_probe()
            return
        transition = state.breaker.record(now, success, probe=admitted.probe)
        if transition is not None:
            self._transitioned(state, transition)

    # -- picking a pod, or waiting for one -------------------------------------------------

    def choose(
        self,
        state: ServiceState,
        tried: set[str],
        sticky: bytes | None,
        prefix: bytes | None,
        now: float,
    ) -> tuple[str, Pod] | None:
        excluded = state.outlier.ejected(now) | tried if tried else state.outlier.ejected(now)
        usable = (
            {v: [p for p in pods if p.id not in excluded] for v, pods in state.ready.items()}
            if excluded
            else state.ready
        )
        available = {v for v, pods in usable.items() if pods}
        variant = choose_variant(state.service.weights, available, rng=self.rng, sticky=sticky)
        if variant is None:
            return None
        loads = self.loads()
        candidates = []
        by_id = {}
        for pod in usable[variant]:
            load = loads.get(pod.id)
            candidates.append(
                Candidate(
                    pod.id,
                    self.outstanding.get(pod.id, 0),
                    None if load is None else load.waiting,
                    None if load is None else load.kv_usage,
                )
            )
            by_id[pod.id] = pod
        chosen = pick(
            candidates,
            rng=self.rng,
            key=prefix,
            ring=state.rings.get(variant),
            load_factor=state.service.routing.load_factor,
        )
        return None if chosen is None else (variant, by_id[chosen.name])

    async def hold(self, state: ServiceState, until: float, out: Outcome) -> None:
        """Wait for a ready pod (scale from zero), in a bounded queue."""
        loop = asyncio.get_running_loop()
        ns, name = state.key
        if state.held >= self.max_held:
            self.metrics.rejected.labels(ns, name, "hold_queue_full").inc()
            raise GatewayError(
                503,
                f"{name} has no ready pod and "
                f"{plural(state.held, 'request already waits', 'requests already wait')} for one",
                "no_ready_pods",
                headers=[(b"retry-after", b"5")],
            )
        started = loop.time()
        state.held += 1
        self.metrics.held.labels(ns, name).set(state.held)
        self.metrics.held_total.labels(ns, name).inc()
        if state.held_since is None:
            state.held_since = started
            self.hooks.on_hold(state)
        try:
            await asyncio.wait_for(state.ready_event.wait(), max(0.0, until - started))
        except TimeoutError:
            self.metrics.rejected.labels(ns, name, "hold_timeout").inc()
            raise GatewayError(
                503,
                f"{name} has no ready pod; waited {loop.time() - started:.0f} s for one",
                "no_ready_pods",
                headers=[(b"retry-after", b"5")],
            ) from None
        finally:
            out.held_seconds += loop.time() - started
            state.held -= 1
            self.metrics.held.labels(ns, name).set(state.held)
            if state.held == 0:
                state.held_since = None
                self.hooks.on_hold(state)

    # -- what each attempt at a pod tells -------------------------------------------------

    def sent(self, pod: Pod) -> None:
        self.outstanding[pod.id] = self.outstanding.get(pod.id, 0) + 1

    def answered(self, state: ServiceState, pod: Pod, outcome: str, now: float) -> None:
        """An attempt at ``pod`` ended with ``outcome``: one fewer in flight, and a mark for
        or against the pod with the outlier detector."""
        self.outstanding[pod.id] -= 1
        if not self.outstanding[pod.id]:
            del self.outstanding[pod.id]
        ns, name = state.key
        ejection = state.outlier.record(pod.id, now, outcome not in _POD_FINE, state.pod_count)
        if ejection is None:
            return
        self.metrics.ejections.labels(ns, name, pod.id).inc()
        self.metrics.ejected.labels(ns, name).set(len(state.outlier.ejected(now)))
        log.warning(
            "pod ejected",
            extra={
                "namespace": ns,
                "service": name,
                "pod": pod.id,
                "seconds": ejection.seconds,
                "times": ejection.times,
            },
        )
