"""The cluster: what the router's decisions need between requests, kept per service and per pod.

Per service a circuit breaker (with its fallback), an outlier detector, a hash ring per variant
and the flow queue (``ladle.gateway.flow``) where requests wait for a free slot, or for a ready
pod at zero; per pod the requests in flight. It is rebuilt from each new route table, keeping
the state of services that remain, and reports breaker transitions and hold episodes through
``Hooks`` (the status writer subscribes there). Everything runs on one event loop, so none of
it needs a lock.

A pod's slots are the service's ``concurrency`` (the engine's ``maxNumSeqs`` unless
``spec.routing.maxConcurrency`` says otherwise). A slot is taken by this gateway's own requests
in flight, counted exactly, and by everyone else's: the pod's own running and waiting counts at
the last scrape, less what this gateway had in flight then. Several gateway replicas thus share
the pods' real limits with the pods as the truth; between two scrapes another replica's new
requests are unseen, and wait in the pod's own queue until the next scrape shows them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ladle.gateway.breaker import Admission, Transition
from ladle.gateway.context import Outcome
from ladle.gateway.errors import GatewayError
from ladle.gateway.flow import Entry
from ladle.gateway.inflight import InFlight
from ladle.gateway.metrics import GatewayMetrics, TenantLabels
from ladle.gateway.picker import Candidate, pick
from ladle.gateway.routes import Pod, RouteTable, Service, ServiceKey
from ladle.gateway.scrape import PodLoad
from ladle.gateway.service_state import ServiceState, Waiter
from ladle.gateway.settings import DEFAULT_BANDS
from ladle.gateway.split import choose_variant
from ladle.gateway.upstream import Pool
from ladle.words import plural

log = logging.getLogger("ladle.gateway")

MAX_FALLBACK_HOPS = 3
# Outcomes of an attempt that say nothing against the pod.
_POD_FINE = frozenset({"ok", "http_4xx", "client_deadline"})
# How fast the mean time a request holds a slot follows new requests (for Retry-After).
SLOT_EWMA = 0.05


@dataclass(slots=True)
class Ask:
    """What binding needs to know of one request (the router's attempts extend it: one object
    a request, since every object the data path allocates is garbage-collector work)."""

    band: int
    level: int  # ``ServiceState.arrive``'s: the band, and whether its tenant is under its share
    tenant: str
    deadline: float
    cost: float  # tokens it is expected to cost its tenant's fair share
    tried: set[str]  # pods already tried: a retry goes elsewhere
    sticky: bytes | None
    prefix: bytes | None

    def expired(self) -> GatewayError:
        """The answer when the deadline passes while the request waits."""
        return GatewayError(504, "the request's deadline passed", "deadline_exceeded")


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
    bands: tuple[str, ...] = DEFAULT_BANDS
    default_band: int = 1
    hooks: Hooks = field(default_factory=Hooks)
    loads: Callable[[], dict[str, PodLoad]] = dict
    rng: random.Random = field(default_factory=random.Random)
    table: RouteTable = field(default_factory=RouteTable)
    states: dict[ServiceKey, ServiceState] = field(default_factory=dict)
    tenants: TenantLabels = field(default_factory=TenantLabels)

    def __post_init__(self) -> None:
        # Levels (``ServiceState.arrive``): two per band.
        self.in_flight = InFlight(2 * len(self.bands))

    # -- table updates and time ----------------------------------------------------------

    def update(self, table: RouteTable, now: float) -> None:
        old_pods = {
            p for variants in self.table.pods.values() for ps in variants.values() for p in ps
        }
        self.table = table
        for key in self.states.keys() - table.services.keys():
            removed = self.states.pop(key)
            for entry in removed.queue.entries():
                if not entry.payload.future.done():
                    entry.payload.future.set_exception(
                        GatewayError(503, f"{key[1]} was deleted while the request waited", "gone")
                    )
            self.metrics.forget_service(*key)
        for key, service in table.services.items():
            state = self.states.get(key)
            if state is None:
                state = self.states[key] = ServiceState(
                    service, now, len(self.bands), self.max_held
                )
                self.metrics.breaker(*key, state.breaker.state)
                self.metrics.new_service(*key, self.bands)
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
            self.pump(state, now)

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

    def models(self) -> list[tuple[str, Service]]:
        """Every routed model name, with the service that serves it."""
        return sorted(self.table.by_model.items())

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

    # -- binding a request to a pod's free slot, or queueing it until one frees -----------

    def place(self, state: ServiceState, ask: Ask, now: float) -> Pod | None:
        """A pod with a free slot for this request, the slot already taken (``answered`` gives
        it back), when one is free and no request waits before it; None otherwise: ``wait``.
        Synchronous, so that a request that need not wait costs no coroutine. Only lower bands
        waiting is no reason to wait: this request would go first, and may displace one."""
        queue = state.queue
        if queue.length and any(queue.band_length(b) for b in range(ask.band + 1)):
            return None
        usable = self._usable(state, ask.tried, now)
        variant = self._variant(state, usable, ask.sticky)
        if variant is None:
            return None
        pod = self._free_pod(state, usable[variant], variant, ask.prefix, ask.level)
        if pod is not None:
            self.sent(pod, ask.level)
            if not ask.tried:  # a retry is not charged twice
                state.queue.charge(ask.band, ask.tenant, ask.cost)
        return pod

    async def wait(self, state: ServiceState, ask: Ask, out: Outcome) -> Pod | None:
        """Wait in the service's flow queue for a free slot, or for a ready pod at zero: late
        binding, so that a saturated pod's own queue stays empty and the request goes to
        whichever pod frees a slot first. None when every pod left has been tried. Raises the
        queue's refusals (429 when shed) and the deadline's."""
        loop = asyncio.get_running_loop()
        usable = self._usable(state, ask.tried, loop.time())
        variant = self._variant(state, usable, ask.sticky)
        if variant is None and ask.tried:
            return None
        waiter = Waiter(ask.level, variant, ask.tried, ask.sticky, ask.prefix, loop.create_future())
        return await self._wait(state, ask, waiter, out)

    async def _wait(
        self, state: ServiceState, ask: Ask, waiter: Waiter, out: Outcome
    ) -> Pod | None:
        loop = asyncio.get_running_loop()
        ns, name = state.key
        started = loop.time()
        band = self.bands[ask.band]
        cost = 0.0 if ask.tried else ask.cost  # a retry is not charged twice
        entry: Entry[Waiter] = Entry(ask.band, ask.tenant, ask.deadline, cost, waiter)
        shed = state.queue.push(entry)
        if shed is entry:
            raise self._overloaded(state, entry, "queue_full")
        if shed is not None:
            shed.payload.future.set_exception(self._overloaded(state, shed, "displaced"))
        tenant = self.tenants.label(ask.tenant)
        self.metrics.queued(ns, name, band, tenant).inc()
        if state.service.priority_scheduling and ask.level < 2 * len(self.bands) - 1:
            self.pump(state, started)  # it may displace a lower level at once
        self._count_queue(state)
        hold_until = started + state.service.timeouts.scale_from_zero_seconds
        if state.held_since is None and not state.pod_count:
            state.held_since = started
            self.hooks.on_hold(state)
        try:
            while True:
                until = ask.deadline if state.pod_count else min(ask.deadline, hold_until)
                done, _ = await asyncio.wait({waiter.future}, timeout=until - loop.time())
                if done:
                    return waiter.future.result()
                if not state.pod_count:
                    self._count_shed(state, entry, "no_ready_pods")
                    raise GatewayError(
                        503,
                        f"{name} has no ready pod; waited {loop.time() - started:.0f} s for one",
                        "no_ready_pods",
                        headers=[(b"retry-after", b"5")],
                    )
                if loop.time() >= ask.deadline:
                    self._count_shed(state, entry, "deadline")
                    raise ask.expired()
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                granted = future.result()  # a slot given as the client left: give it back
                if granted is not None:
                    self._release(state, granted, ask.level, loop.time())
            state.queue.remove(entry)
            raise
        finally:
            waited = loop.time() - started
            out.held_seconds += waited
            self.metrics.queue_wait(ns, name, band).observe(waited)
            self.metrics.tenant_wait(ns, name, band, tenant).inc(waited)
            self._count_queue(state)
            if not len(state.queue) and state.held_since is not None:
                state.held_since = None
                self.hooks.on_hold(state)

    def _count_shed(self, state: ServiceState, entry: Entry[Waiter], reason: str) -> None:
        """Count a request the queue gives up on."""
        self.metrics.shed(*state.key, self.bands[entry.band], reason).inc()

    def _overloaded(self, state: ServiceState, entry: Entry[Waiter], reason: str) -> GatewayError:
        """Count a request shed for room, and the 429 it is answered with."""
        self._count_shed(state, entry, reason)
        name = state.key[1]
        band = self.bands[entry.band]
        waiting = len(state.queue)
        slots = max(1, state.service.concurrency * state.pod_count)
        retry = min(60, max(1, math.ceil(waiting * state.slot_seconds / slots)))
        what = "queue is full" if reason == "queue_full" else "queue made room for a higher band"
        return GatewayError(
            429,
            f"{name} is overloaded: its {what} ({plural(waiting, 'request waits', 'requests wait')}"
            f" for a free slot) and {band!r} is the lowest priority waiting; retry in {retry} s",
            "queue_full",
            headers=[(b"retry-after", str(retry).encode())],
        )

    def pump(self, state: ServiceState, now: float) -> None:
        """Hand free slots to waiting requests, in the flow queue's order."""
        granted = False
        while state.queue.length:
            entry = state.queue.pop(lambda e: self._fits(state, e, now))
            if entry is None:
                break
            waiter = entry.payload
            assert waiter.placed is not None
            self.sent(waiter.placed, waiter.level)
            if not waiter.future.done():
                waiter.future.set_result(waiter.placed)
            granted = True
        if granted:
            self._count_queue(state)

    def pump_all(self, now: float) -> None:
        """After new loads were scraped: other gateways' requests may have finished."""
        for state in self.states.values():
            self.pump(state, now)

    def _fits(self, state: ServiceState, entry: Entry[Waiter], now: float) -> bool:
        """Whether a pod has a free slot for ``entry`` now (or one its band may take, see
        ``_free_pod``); records which in ``placed``."""
        waiter = entry.payload
        usable = self._usable(state, waiter.tried, now)
        variant = waiter.variant if waiter.variant in usable else None
        if variant is None:
            variant = self._variant(state, usable, waiter.sticky)
            if variant is None:
                return False
        waiter.placed = self._free_pod(state, usable[variant], variant, waiter.prefix, waiter.level)
        return waiter.placed is not None

    def _free_pod(
        self, state: ServiceState, pods: list[Pod], variant: str, prefix: bytes | None, level: int
    ) -> Pod | None:
        """The picker's choice among ``pods`` that have a free slot; failing that, where the
        pods' engines order by priority, among those where this request may displace one of
        this gateway's requests of a lower level (each may be displaced once: the pod holds one
        request beyond its slots for each), which the engine then preempts for it. So a higher
        band, or a tenant under its share, waits for the pod's next step, not for the next
        request to finish; the displaced one waits in the pod's queue, its tokens kept, and
        resumes when a slot frees."""
        limit = state.service.concurrency
        loads = self.loads()
        candidates = []
        displacing: list[Candidate] | None = None
        by_id = {}
        for pod in pods:
            load = loads.get(pod.id)
            own = self.in_flight(pod.id)
            over = own + (0 if load is None else load.others) - limit
            if limit and over >= 0:
                if state.service.priority_scheduling and self.in_flight.below(pod.id, level) > over:
                    if displacing is None:
                        displacing = []
                    displacing.append(Candidate(pod.id, own, None, None))
                    by_id[pod.id] = pod
                continue
            candidates.append(
                Candidate(
                    pod.id,
                    own,
                    None if load is None else load.waiting,
                    None if load is None else load.kv_usage,
                )
            )
            by_id[pod.id] = pod
        chosen = pick(
            candidates if candidates or displacing is None else displacing,
            rng=self.rng,
            key=prefix,
            ring=state.rings.get(variant),
            load_factor=state.service.routing.load_factor,
        )
        return None if chosen is None else by_id[chosen.name]

    def engine_priority(self, level: int) -> int:
        """vLLM's request ``priority`` for a level: lower runs first, and 0, the engine's
        default, is the default band's level over its share (as a tenant alone is)."""
        return level - (2 * self.default_band + 1)

    def _usable(self, state: ServiceState, tried: set[str], now: float) -> dict[str, list[Pod]]:
        """Each variant's ready pods that are neither ejected nor tried, where any are left."""
        excluded = state.outlier.ejected(now) | tried if tried else state.outlier.ejected(now)
        if not excluded:
            return state.ready
        usable = {v: [p for p in pods if p.id not in excluded] for v, pods in state.ready.items()}
        return {v: pods for v, pods in usable.items() if pods}

    def _variant(
        self, state: ServiceState, usable: dict[str, list[Pod]], sticky: bytes | None
    ) -> str | None:
        """The variant by the split's weights, among those with a usable pod: chosen on
        arrival, so that waiting for a slot does not bend the canary's share."""
        return choose_variant(state.service.weights, usable, rng=self.rng, sticky=sticky)

    def _count_queue(self, state: ServiceState) -> None:
        ns, name = state.key
        for i, band in enumerate(self.bands):
            self.metrics.held(ns, name, band).set(state.queue.band_length(i))

    # -- what each attempt at a pod tells -------------------------------------------------

    def sent(self, pod: Pod, level: int) -> None:
        self.in_flight.sent(pod.id, level)

    def answered(
        self, state: ServiceState, pod: Pod, level: int, outcome: str, now: float, seconds: float
    ) -> None:
        """An attempt at ``pod`` ended with ``outcome`` after ``seconds``: its slot goes to the
        next waiting request, and the outcome is a mark for or against the pod with the
        outlier detector."""
        if state.slot_timed:
            state.slot_seconds += SLOT_EWMA * (seconds - state.slot_seconds)
        else:
            state.slot_seconds, state.slot_timed = seconds, True
        ns, name = state.key
        ejection = state.outlier.record(pod.id, now, outcome not in _POD_FINE, state.pod_count)
        self._release(state, pod, level, now)  # after the verdict: an ejected pod gets none
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

    def _release(self, state: ServiceState, pod: Pod, level: int, now: float) -> None:
        self.in_flight.done(pod.id, level)
        self.pump(state, now)
