"""InferenceServices and Pods → the route table: which service serves a model, with what policy,
on which pods. Pure: the watch cache hands in plain API objects and gets a new table back.

A model name belongs to one service: a service claims its model's name and each of its LoRA
adapters' (``spec.adapters``), whose requests its pods serve. When several claim one name, the
oldest (by creation time, then
namespace/name) keeps it, as Gateway API resolves conflicting routes; the others are not
routed, and the gateway marks every claimant's status with a ModelNameConflict condition, so
nothing is picked silently. It is the gateway's to report: a conflict exists only among the
namespaces one gateway routes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ladle.api import (
    DEFAULT_MAX_NUM_SEQS,
    LABEL_ISVC,
    LABEL_VARIANT,
    STABLE,
    BreakerConfig,
    OutlierConfig,
    RoutingPolicy,
    Timeouts,
    parse_isvc,
)

ServiceKey = tuple[str, str]  # (namespace, name)
DEFAULT_POD_PORT = 8000


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    model: str
    created: str = ""
    fallback: str | None = None
    # Replicas the spec asks for: 0 means scaled to zero, so no ready pod is not a failure.
    replicas: int = 1
    weights: tuple[tuple[str, int], ...] = ((STABLE, 100),)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    # The breaker state a gateway last wrote into status.gateway (None: never written).
    reported_breaker: str | None = None
    # spec.responseCache.enabled, and what a cached answer is valid for: the revision each
    # variant's pods all run (variant, revision).
    response_cache: bool = False
    revisions: tuple[tuple[str, str], ...] = ()
    # Slots per pod: requests a pod takes from the gateway at once (0: no limit).
    concurrency: int = DEFAULT_MAX_NUM_SEQS
    # The pods' engines order by vLLM's ``priority`` (``--scheduling-policy priority``): the
    # gateway sends each request's band there, and may bind a higher band beyond a full pod's
    # slots where one of its own lower-band requests runs, for the engine to displace.
    priority_scheduling: bool = False
    # The names of its LoRA adapters, each also a model name it serves.
    adapters: tuple[str, ...] = ()

    @property
    def key(self) -> ServiceKey:
        return (self.namespace, self.name)

    @property
    def names(self) -> tuple[str, ...]:
        """Every model name it claims: its model's, then its adapters'."""
        return (self.model, *self.adapters)

    def revision(self, variant: str) -> str | None:
        return dict(self.revisions).get(variant)


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    service: str
    variant: str
    host: str
    port: int
    ready: bool

    @property
    def service_key(self) -> ServiceKey:
        return (self.namespace, self.service)

    @functools.cached_property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Conflict:
    model: str
    owner: ServiceKey
    others: tuple[ServiceKey, ...]


@dataclass(frozen=True)
class RouteTable:
    services: Mapping[ServiceKey, Service] = field(default_factory=dict)
    by_model: Mapping[str, Service] = field(default_factory=dict)
    conflicts: Mapping[str, Conflict] = field(default_factory=dict)
    # Every pod of a service, ready or not, by variant; sorted by name.
    pods: Mapping[ServiceKey, Mapping[str, tuple[Pod, ...]]] = field(default_factory=dict)

    def conflict_of(self, key: ServiceKey) -> Conflict | None:
        """The first conflict over one of this service's names, if any."""
        service = self.services.get(key)
        for name in service.names if service is not None else ():
            conflict = self.conflicts.get(name)
            if conflict is not None and (conflict.owner == key or key in conflict.others):
                return conflict
        return None

    def ready_pods(self, key: ServiceKey) -> dict[str, list[Pod]]:
        return {
            variant: ready
            for variant, pods in self.pods.get(key, {}).items()
            if (ready := [p for p in pods if p.ready])
        }


def parse_service(obj: Mapping[str, Any]) -> Service:
    """One InferenceService, as ``ladle.api`` parses it for every component."""
    isvc = parse_isvc(obj)
    meta, spec, status = isvc.meta, isvc.spec, isvc.status
    traffic = spec.traffic
    weights = tuple(
        (str(w["variant"]), int(w.get("weight", 0)))
        for w in ((status.get("rollout") or {}).get("weights") or ())
        if w.get("variant")
    )
    return Service(
        namespace=meta.namespace,
        name=meta.name,
        model=spec.served_model_name,
        created=meta.created,
        fallback=traffic.fallback,
        replicas=spec.replicas,
        weights=weights or ((STABLE, 100),),
        routing=traffic.routing,
        breaker=traffic.breaker,
        outlier=traffic.outlier,
        timeouts=traffic.timeouts,
        reported_breaker=((status.get("gateway") or {}).get("breaker") or {}).get("state"),
        response_cache=traffic.response_cache,
        revisions=_revisions(status),
        concurrency=(
            traffic.routing.max_concurrency
            if traffic.routing.max_concurrency is not None
            else spec.engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        ),
        priority_scheduling=spec.engine.scheduling_policy == "priority",
        adapters=tuple(a.name for a in spec.adapters or ()),
    )


def _revisions(status: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The revision each variant's pods run, as the operator names it in status (the one digest
    of model source, quantization, engine and runtime image, ``operator.revisions``). The spec
    does not say it: during a canary the stable pods still run the old revision. A variant whose
    pods are being replaced has none, since its pods answer from two revisions."""
    return tuple(
        (str(v["name"]), str(v["revision"]))
        for v in status.get("variants") or ()
        if v.get("name")
        and v.get("revision")
        and int(v.get("updatedReplicas") or 0) == int(v.get("replicas") or 0)
    )


def parse_routable(obj: Mapping[str, Any]) -> Service | None:
    """An InferenceService the gateway routes to: any that is not being deleted (the operator
    counts model-name claims the same way)."""
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return None
    return parse_service(obj)


def _container_port(spec: Mapping[str, Any]) -> int:
    for container in spec.get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return DEFAULT_POD_PORT


def parse_pod(obj: Mapping[str, Any]) -> Pod | None:
    """A runtime pod, or None for a pod that belongs to no InferenceService."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    service = labels.get(LABEL_ISVC)
    if not service:
        return None
    status = obj.get("status") or {}
    ready_condition = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    ip = status.get("podIP") or ""
    return Pod(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta["name"]),
        service=str(service),
        variant=str(labels.get(LABEL_VARIANT) or STABLE),
        host=str(ip),
        port=_container_port(obj.get("spec") or {}),
        # A terminating pod is draining: it finishes what it has and takes nothing new.
        ready=ready_condition and bool(ip) and not meta.get("deletionTimestamp"),
    )


def model_claims(services: Iterable[Service]) -> tuple[dict[str, Service], dict[str, Conflict]]:
    """Each model name's owner, and the names claimed more than once."""
    claimants: dict[str, list[Service]] = {}
    for svc in services:
        for name in svc.names:
            claimants.setdefault(name, []).append(svc)
    owners: dict[str, Service] = {}
    conflicts: dict[str, Conflict] = {}
    for model, group in claimants.items():
        group.sort(key=lambda s: (s.created, s.namespace, s.name))
        owners[model] = group[0]
        if len(group) > 1:
            conflicts[model] = Conflict(model, group[0].key, tuple(s.key for s in group[1:]))
    return owners, conflicts


def build_table(services: Iterable[Service], pods: Iterable[Pod]) -> RouteTable:
    by_key = {s.key: s for s in services}
    owners, conflicts = model_claims(by_key.values())
    grouped: dict[ServiceKey, dict[str, list[Pod]]] = {}
    for pod in pods:
        if pod.service_key in by_key:
            grouped.setdefault(pod.service_key, {}).setdefault(pod.variant, []).append(pod)
    return RouteTable(
        services=by_key,
        by_model=owners,
        conflicts=conflicts,
        pods={
            key: {v: tuple(sorted(ps, key=lambda p: p.name)) for v, ps in variants.items()}
            for key, variants in grouped.items()
        },
    )
