"""Write the status the reconcilers derived, and tell its transitions as Events.

Status is server-side applied to the status subresource under the operator's field manager,
with only the fields the operator owns (``status.ISVC_STATUS_FIELDS`` and its condition types).
Other writers keep theirs: the gateway, say, records circuit-breaker state in the same status
under its own field manager, and this writer neither removes it nor mistakes it for a change
that needs writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ladle.api import JSON
from ladle.kube import ApiError, KubeClient
from ladle.operator.conditions import DEGRADED, PROGRESSING, READY, owned_status
from ladle.operator.events import EventRecorder, ObjectRef


class StatusWriter:
    def __init__(self, client: KubeClient, recorder: EventRecorder) -> None:
        self.client = client
        self.recorder = recorder
        # The status last written per object (by uid): fresher than the watch cache.
        self._written: dict[str, JSON] = {}

    def previous(
        self,
        uid: str,
        stored: Mapping[str, Any],
        fields: Sequence[str],
        types: Sequence[str],
    ) -> JSON:
        """What the operator last wrote to this object, as far as it knows."""
        return self._written.get(uid) or owned_status(stored, fields, types)

    def is_echo(
        self, uid: str, stored: Mapping[str, Any], fields: Sequence[str], types: Sequence[str]
    ) -> bool:
        """Whether a stored status is just what the operator wrote last."""
        written = self._written.get(uid)
        return written is not None and owned_status(stored, fields, types) == written

    def forget(self, uid: str) -> None:
        self._written.pop(uid, None)

    async def write(self, ref: ObjectRef, status: JSON, previous: Mapping[str, Any]) -> None:
        """Apply ``status`` (if it differs from ``previous``) and announce what changed."""
        if status == previous:
            return
        metadata = {"name": ref.name, **({"namespace": ref.namespace} if ref.namespace else {})}
        body = {
            "apiVersion": ref.api_version,
            "kind": ref.kind,
            "metadata": metadata,
            "status": status,
        }
        try:
            await self.client.apply(body, subresource="status")
        except ApiError as err:
            if err.status == 404:
                return  # deleted meanwhile
            raise
        self._written[ref.uid] = status
        self._announce(ref, status, previous)

    def _announce(self, ref: ObjectRef, status: JSON, previous: Mapping[str, Any]) -> None:
        old = {c.get("type"): c for c in previous.get("conditions") or ()}
        for cond in status["conditions"]:
            prior = old.get(cond["type"]) or {}
            type_, on, was = cond["type"], cond["status"] == "True", prior.get("status") == "True"
            if type_ == READY and on and not was:
                self.recorder.emit(ref, "Normal", "Ready", cond["message"])
            elif type_ == PROGRESSING and on and not was and old:
                # Not on creation: "it started" says nothing that Ready will not say.
                self.recorder.emit(ref, "Normal", "RollingOut", cond["message"])
            elif type_ == DEGRADED and on and prior.get("reason") != cond["reason"]:
                self.recorder.emit(ref, "Warning", cond["reason"], cond["message"])
            elif type_ == DEGRADED and not on and was:
                self.recorder.emit(ref, "Normal", "Recovered", "No longer degraded")
