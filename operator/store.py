"""The watch cache: what the operator knows of each object, with indexes, and nothing else.

Every kind is kept as a small summary (a parsed spec, a trimmed child, a pod's few facts), by
(namespace, name). Indexers map an object to index values (its owner, its pool), and the
indexes follow every upsert and delete, so nothing needs clearing by hand when an object goes.

kopf re-lists after a watch gap (410 Gone) without telling what vanished meanwhile; ``replace``
does what client-go's Reflector does then: it evicts every object of a kind that a fresh list
no longer holds, unless a watch event about it arrived after the list began.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ladle.api import (
    CONFIG_HASH_ANNOTATION,
    GROUP_TEMPLATE_ANNOTATION,
    HTTP_ROUTE_KIND,
    INFERENCE_POOL_KIND,
    JSON,
    LABEL_ISVC,
    LABEL_POOL,
    LABEL_VARIANT,
    LABEL_WORKER_OF,
    MODEL_REWRITE_KIND,
    STABLE,
    GPUPoolSpec,
    parse_rfc3339,
)
from ladle.operator.pod_problems import pod_problem, refusal, starting_since
from ladle.quantity import quantity_to_int

ObjKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped kinds
Indexer = Callable[[Any], Iterable[Any]]

# Kinds whose metadata.generation moves only when their spec does (a GAIE gateway writes an
# InferencePool's or an HTTPRoute's status: that is not a change to revert).
GENERATION_KINDS = frozenset(
    {
        "Deployment",
        "StatefulSet",
        "PodDisruptionBudget",
        INFERENCE_POOL_KIND,
        HTTP_ROUTE_KIND,
        MODEL_REWRITE_KIND,
    }
)


@dataclass(frozen=True)
class NodeInfo:
    """The parts of a Node that pool accounting reads (kept small: nodes heartbeat often)."""

    name: str
    labels: Mapping[str, str]
    ready: bool
    unschedulable: bool
    capacity: Mapping[str, str]
    allocatable: Mapping[str, str]

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> NodeInfo:
        meta = node.get("metadata") or {}
        status = node.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        return cls(
            name=str(meta.get("name")),
            labels=dict(meta.get("labels") or {}),
            ready=ready,
            unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
            capacity=dict(status.get("capacity") or {}),
            allocatable=dict(status.get("allocatable") or {}),
        )

    def gpus(self, resource: str, allocatable: bool = False) -> int:
        source = self.allocatable if allocatable else self.capacity
        return quantity_to_int(source.get(resource, "0"))


def node_matches(pool: GPUPoolSpec, node: NodeInfo) -> bool:
    selector = pool.scheduling_selector()
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    return node.gpus(pool.resource_name) > 0


@dataclass(frozen=True)
class PodInfo:
    """A runtime pod, as quota and status read it."""

    namespace: str
    name: str
    owner: str  # its InferenceService
    variant: str
    pool: str | None
    # Extended resources it asks for (GPUs), by resource name.
    limits: Mapping[str, int]
    # It exists and has not finished: it holds its GPUs, even while terminating.
    holds: bool
    # The scheduler's reason, or the first container's waiting reason, and its message.
    problem: tuple[str, str] | None
    # Since when (seconds since the epoch) it waits on its node with no container started yet
    # (every container in a normal wait): only its Events can tell a slow start from a
    # volume that cannot be mounted.
    starting_since: float | None = None
    # The runtime's HTTP address while the pod is Ready: the autoscaler reads its /metrics
    # there, and the canary analysis its metrics and its OpenAI API.
    base_url: str | None = None
    # The ReplicaSet that owns it ("" if none): the autoscaler learns a pace per pod template.
    replica_set: str = ""
    # Seconds from its creation to Ready, once Ready: the autoscaler projects a rising load
    # over the time a new replica takes to serve.
    start_seconds: float | None = None
    # What a group's leader tells the operator to make its workers (spec.parallelism.nodes):
    # the template digest it runs, its uid (their owner), node and address.
    uid: str = ""
    group_template: str = ""
    node: str = ""
    ip: str = ""
    deleting: bool = False
    # A group's worker: it serves no API, so it has no base_url.
    worker: bool = False
    # What its runtime said when it refused its settings (exit EX_CONFIG), and then a digest
    # of those settings (``runtime_settings``): no restart of that template can serve.
    refused: str | None = None
    settings: str = ""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodInfo:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = pod.get("status") or {}
        limits: dict[str, int] = {}
        for container in (pod.get("spec") or {}).get("containers") or ():
            for name, value in ((container.get("resources") or {}).get("limits") or {}).items():
                if "/" in name:
                    limits[name] = limits.get(name, 0) + quantity_to_int(value)
        deleting = bool(meta.get("deletionTimestamp"))
        worker = LABEL_WORKER_OF in labels
        refused = refusal(status)
        return cls(
            namespace=str(meta.get("namespace")),
            name=str(meta.get("name")),
            owner=str(labels.get(LABEL_WORKER_OF if worker else LABEL_ISVC)),
            variant=str(labels.get(LABEL_VARIANT, STABLE)),
            pool=labels.get(LABEL_POOL),
            limits=limits,
            holds=status.get("phase") not in ("Succeeded", "Failed"),
            problem=None if deleting else pod_problem(pod),
            starting_since=None if deleting else starting_since(pod),
            base_url=None if deleting or worker else _base_url(pod),
            start_seconds=_start_seconds(pod),
            replica_set=next(
                (
                    str(ref.get("name"))
                    for ref in meta.get("ownerReferences") or ()
                    if ref.get("kind") == "ReplicaSet"
                ),
                "",
            ),
            uid=str(meta.get("uid") or ""),
            group_template=str((meta.get("annotations") or {}).get(GROUP_TEMPLATE_ANNOTATION, "")),
            node=str((pod.get("spec") or {}).get("nodeName") or ""),
            ip=str(status.get("podIP") or ""),
            deleting=deleting,
            worker=worker,
            refused=refused,
            settings=runtime_settings(pod) if refused else "",
        )

    @property
    def leads(self) -> tuple[str, str, str, str] | None:
        """What its group's workers are made from, for a live leader placed on a node."""
        if not self.group_template or self.deleting or not self.ip:
            return None
        return (self.uid, self.group_template, self.node, self.ip)

    def gpus(self, resource: str) -> int:
        return self.limits.get(resource, 0) if self.holds else 0

    @property
    def metrics_url(self) -> str | None:
        return None if self.base_url is None else f"{self.base_url}/metrics"


def _base_url(pod: Mapping[str, Any]) -> str | None:
    """The pod's address and its "http" port, if the pod is Ready."""
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )
    if not ready or not status.get("podIP"):
        return None
    host = str(status["podIP"])
    host = f"[{host}]" if ":" in host else host
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http":
                return f"http://{host}:{port['containerPort']}"
    return None


def _start_seconds(pod: Mapping[str, Any]) -> float | None:
    """How long a Ready pod took from creation to Ready (scheduling, image pull, model load,
    warm-up): the kubelet's own timestamps, to the second."""
    created = parse_rfc3339((pod.get("metadata") or {}).get("creationTimestamp"))
    ready = next(
        (
            parse_rfc3339(c.get("lastTransitionTime"))
            for c in (pod.get("status") or {}).get("conditions") or ()
            if c.get("type") == "Ready" and c.get("status") == "True"
        ),
        None,
    )
    if created is None or ready is None or ready < created:
        return None
    return ready - created


def runtime_settings(pod_or_template: Mapping[str, Any]) -> str:
    """A digest of what the runtime container is told (image, flags, the ConfigMap's digest),
    the same for a pod template and the pods made from it."""
    meta = pod_or_template.get("metadata") or {}
    containers = (pod_or_template.get("spec") or {}).get("containers") or [{}]
    runtime: Mapping[str, Any] = containers[0]
    told = [
        runtime.get("image"),
        runtime.get("args"),
        (meta.get("annotations") or {}).get(CONFIG_HASH_ANNOTATION),
    ]
    return hashlib.sha256(json.dumps(told).encode()).hexdigest()[:16]


def child_version(obj: Mapping[str, Any]) -> str:
    """What moves when someone changes a child's spec (its generation where it has one)."""
    meta = obj.get("metadata") or {}
    if obj.get("kind") in GENERATION_KINDS:
        return str(meta.get("generation") or "")
    return str(meta.get("resourceVersion") or "")


def trim_child(obj: Mapping[str, Any]) -> JSON:
    """Keep what reconciles read; managedFields and pod templates would only cost memory."""
    meta = obj.get("metadata") or {}
    out: JSON = {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {
            key: meta[key]
            for key in (
                "name",
                "namespace",
                "uid",
                "generation",
                "resourceVersion",
                "labels",
                "annotations",
                "ownerReferences",
            )
            if key in meta
        },
    }
    if obj.get("kind") == "Deployment":
        spec = obj.get("spec") or {}
        out["spec"] = {"replicas": spec.get("replicas", 1), "strategy": spec.get("strategy")}
        out["status"] = obj.get("status") or {}
    return out


def child_relevant(child: Mapping[str, Any] | None) -> object:
    """What a reconcile reads from a cached child: other changes need no reconcile."""
    if child is None:
        return None
    meta = child.get("metadata") or {}
    mine = (meta.get("labels"), meta.get("annotations"), meta.get("ownerReferences"))
    if child.get("kind") == "Deployment":
        return (mine, meta.get("generation"), child.get("spec"), child.get("status"))
    return (mine, child_version(child))


class Store:
    """Objects by kind and key, with indexes and per-object event sequence numbers."""

    def __init__(self) -> None:
        self._objects: dict[str, dict[ObjKey, Any]] = {}
        self._indexers: dict[str, dict[str, Indexer]] = {}
        self._indexes: dict[tuple[str, str], dict[Any, set[ObjKey]]] = {}
        # The sequence number of the last event about each object, deleted ones included.
        self._touched: dict[tuple[str, ObjKey], int] = {}
        self.sequence = 0

    def add_indexer(self, kind: str, name: str, indexer: Indexer) -> None:
        self._indexers.setdefault(kind, {})[name] = indexer
        self._indexes[(kind, name)] = {}

    def get(self, kind: str, key: ObjKey) -> Any:
        return self._objects.get(kind, {}).get(key)

    def keys(self, kind: str) -> list[ObjKey]:
        return list(self._objects.get(kind, {}))

    def values(self, kind: str) -> Iterator[Any]:
        return iter(list(self._objects.get(kind, {}).values()))

    def count(self, kind: str) -> int:
        return len(self._objects.get(kind, {}))

    def by_index(self, kind: str, index: str, value: Any) -> list[Any]:
        objects = self._objects.get(kind, {})
        keys = self._indexes[(kind, index)].get(value, ())
        return [objects[k] for k in sorted(keys)]

    def index_keys(self, kind: str, index: str, value: Any) -> list[ObjKey]:
        return sorted(self._indexes[(kind, index)].get(value, ()))

    def touched(self, kind: str, key: ObjKey) -> int:
        return self._touched.get((kind, key), 0)

    def upsert(self, kind: str, key: ObjKey, obj: Any) -> Any:
        """Store ``obj``; return what was there before (None if nothing)."""
        old = self._objects.setdefault(kind, {}).get(key)
        self._unindex(kind, key, old)
        self._objects[kind][key] = obj
        self._index(kind, key, obj)
        self._touch(kind, key)
        return old

    def delete(self, kind: str, key: ObjKey) -> Any:
        old = self._objects.get(kind, {}).pop(key, None)
        self._unindex(kind, key, old)
        self._touch(kind, key)
        return old

    def stale(self, kind: str, listed: Iterable[ObjKey], since: int) -> list[ObjKey]:
        """Keys a list begun at sequence ``since`` no longer holds, with no event after it."""
        present = set(listed)
        return [
            key
            for key in self._objects.get(kind, {})
            if key not in present and self.touched(kind, key) <= since
        ]

    def forget_touches(self, before: int) -> None:
        """Drop the sequence numbers of deleted objects older than ``before`` (bounded memory)."""
        for (kind, key), seq in list(self._touched.items()):
            if seq < before and key not in self._objects.get(kind, {}):
                del self._touched[(kind, key)]

    def _touch(self, kind: str, key: ObjKey) -> None:
        self.sequence += 1
        self._touched[(kind, key)] = self.sequence

    def _index(self, kind: str, key: ObjKey, obj: Any) -> None:
        for name, indexer in self._indexers.get(kind, {}).items():
            index = self._indexes[(kind, name)]
            for value in indexer(obj):
                index.setdefault(value, set()).add(key)

    def _unindex(self, kind: str, key: ObjKey, obj: Any) -> None:
        if obj is None:
            return
        for name, indexer in self._indexers.get(kind, {}).items():
            index = self._indexes[(kind, name)]
            for value in indexer(obj):
                keys = index.get(value)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del index[value]


def owner_of(child: Mapping[str, Any]) -> Iterable[ObjKey]:
    """Index value: the InferenceService a child belongs to, by its label (a group's workers
    have their own)."""
    meta = child.get("metadata") or {}
    labels = meta.get("labels") or {}
    owner = labels.get(LABEL_ISVC) or labels.get(LABEL_WORKER_OF)
    return [(str(meta.get("namespace")), str(owner))] if owner else []
