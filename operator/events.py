"""Kubernetes Events about InferenceServices and GPUPools, aggregated like client-go's recorder.

An event that repeats (same object, type, reason and message) bumps the ``count`` and
``lastTimestamp`` of the Event already posted instead of adding another, so ``kubectl describe``
shows "x4 over 2m" rather than four lines. Events are posted in the background: they never slow
a reconcile down, and one that cannot be posted is logged and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from ladle.api import GROUP, JSON, rfc3339
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.logs import object_id
from ladle.operator.telemetry import Metrics

log = logging.getLogger("ladle.operator.events")

POSTERS = 2
# Remembered events (client-go keeps 4096 too); the API server's event TTL is an hour.
REMEMBERED = 4096


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def involved(self) -> JSON:
        ref: JSON = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
        }
        if self.namespace:
            ref["namespace"] = self.namespace
        return ref


AggregationKey = tuple[str, str, str, str]  # (uid, type, reason, message)


@dataclass
class Posted:
    namespace: str
    name: str
    count: int


class EventRecorder:
    def __init__(self, client: KubeClient, metrics: Metrics, identity: str) -> None:
        self.client = client
        self.metrics = metrics
        self.identity = identity
        # One queue per poster, each key always to the same one: repeats of one event are
        # posted in order, so the second is a count bump, never a second Event.
        self._queues: list[asyncio.Queue[tuple[AggregationKey, ObjectRef]]] = [
            asyncio.Queue() for _ in range(POSTERS)
        ]
        self._posted: OrderedDict[AggregationKey, Posted] = OrderedDict()

    def emit(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        """Log it, and queue it for posting (or for counting, if it repeats)."""
        message = message[:1024]
        key = (ref.uid, type_, reason, message)
        self._queues[hash(key) % POSTERS].put_nowait((key, ref))
        log.log(
            logging.WARNING if type_ == "Warning" else logging.INFO,
            message,
            extra={
                "event": reason,
                "type": type_,
                "object": object_id(ref.namespace, ref.name),
                "kind": ref.kind,
            },
        )

    async def run(self) -> None:
        """Post queued Events until cancelled."""
        async with asyncio.TaskGroup() as group:
            for index, queue in enumerate(self._queues):
                group.create_task(self._post_forever(queue), name=f"event-poster-{index}")

    async def _post_forever(self, queue: asyncio.Queue[tuple[AggregationKey, ObjectRef]]) -> None:
        while True:
            key, ref = await queue.get()
            try:
                await self._post(key, ref)
                self.metrics.events.labels(key[1], key[2]).inc()
            except REQUEST_ERRORS as err:
                log.warning("could not post event", extra={"reason": key[2], "error": str(err)})

    async def _post(self, key: AggregationKey, ref: ObjectRef) -> None:
        now = rfc3339()
        posted = self._posted.get(key)
        if posted is not None:
            self._posted.move_to_end(key)
            posted.count += 1
            try:
                await self.client.merge_patch(
                    resource_path("v1", "Event", posted.namespace, posted.name),
                    {"count": posted.count, "lastTimestamp": now},
                )
                return
            except ApiError as err:
                if err.status != 404:  # expired (the event TTL): post it afresh
                    raise
        namespace = ref.namespace or "default"
        _, type_, reason, message = key
        created = await self.client.create(
            resource_path("v1", "Event", namespace),
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{ref.name}.", "namespace": namespace},
                "involvedObject": ref.involved(),
                "type": type_,
                "reason": reason,
                "message": message,
                "source": {"component": "ladle-operator"},
                "reportingComponent": f"{GROUP}/operator",
                "reportingInstance": self.identity,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
        )
        self._posted[key] = Posted(namespace, str(created["metadata"]["name"]), 1)
        self._posted.move_to_end(key)
        while len(self._posted) > REMEMBERED:
            self._posted.popitem(last=False)
