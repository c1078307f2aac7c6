"""Pod Events as the kubelet posts them (source ``kubelet``, the node as host), with the
kubelet's aggregation: a repeat of the same reason and message bumps ``count`` on one Event."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from ladle.cluster.agent.kube import JSON, TRANSIENT, ApiError, Kube
from ladle.cluster.agent.node import now

log = logging.getLogger("ladle.node_agent")


class EventRecorder:
    def __init__(self, kube: Kube, node: str) -> None:
        self.kube = kube
        self.node = node
        self._seen: dict[tuple[str, ...], tuple[str, int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def emit(
        self,
        pod: JSON,
        reason: str,
        message: str,
        *,
        warning: bool = False,
        container: str | None = None,
    ) -> None:
        """Post in the background: an Event must never hold up a pod's lifecycle."""
        task = asyncio.create_task(self._post(pod, reason, message, warning, container))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(
        self, pod: JSON, reason: str, message: str, warning: bool, container: str | None
    ) -> None:
        meta = pod["metadata"]
        namespace = meta["namespace"]
        field_path = f"spec.containers{{{container}}}" if container else ""
        key = (meta["uid"], reason, message, field_path)
        base = f"/api/v1/namespaces/{namespace}/events"
        try:
            if key in self._seen:
                name, count = self._seen[key]
                self._seen[key] = (name, count + 1)
                await self.kube.patch(
                    f"{base}/{name}",
                    {"count": count + 1, "lastTimestamp": now()},
                    kind="merge",
                )
                return
            name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
            self._seen[key] = (name, 1)
            involved: dict[str, Any] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta["uid"],
            }
            if field_path:
                involved["fieldPath"] = field_path
            await self.kube.create(
                base,
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": name, "namespace": namespace},
                    "involvedObject": involved,
                    "reason": reason,
                    "message": message,
                    "type": "Warning" if warning else "Normal",
                    "source": {"component": "kubelet", "host": self.node},
                    "reportingComponent": "kubelet",
                    "reportingInstance": self.node,
                    "firstTimestamp": now(),
                    "lastTimestamp": now(),
                    "eventTime": None,
                    "count": 1,
                },
            )
        except ApiError as err:
            if err.status == 404:  # the namespace or the aggregated Event is gone
                self._seen.pop(key, None)
                return
            log.warning("could not post an event", extra={"reason": reason, "error": str(err)})
        except (*TRANSIENT, RuntimeError) as err:  # RuntimeError: the agent is stopping
            log.warning("could not post an event", extra={"reason": reason, "error": str(err)})

    def forget(self, pod_uid: str) -> None:
        for key in [k for k in self._seen if k[0] == pod_uid]:
            del self._seen[key]

    async def flush(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
