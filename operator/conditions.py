"""metav1.Condition as the operator writes it: the condition types of each kind, the status
fields the operator owns (other field managers own the rest), and the merge that keeps a
condition's lastTransitionTime while its status holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ladle.api import JSON

READY = "Ready"
PROGRESSING = "Progressing"
RECONCILING = "Reconciling"
STALLED = "Stalled"
DEGRADED = "Degraded"
# Only while spec.adapters is set: whether every pod serves the adapters it lists.
ADAPTERS_READY = "AdaptersReady"
ISVC_CONDITIONS = (READY, PROGRESSING, RECONCILING, STALLED, DEGRADED, ADAPTERS_READY)
# Written by the autoscaler under its own field manager, as an HPA reports them.
SCALING_ACTIVE = "ScalingActive"
SCALING_LIMITED = "ScalingLimited"
POOL_CONDITIONS = (READY, DEGRADED)
# The status fields the operator writes; other field managers (the gateway) own the rest.
ISVC_STATUS_FIELDS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "availableReplicas",
    "updatedReplicas",
    "selector",
    "url",
    "variants",
    "rollout",
    "adapters",
)
POOL_STATUS_FIELDS = (
    "observedGeneration",
    "nodes",
    "capacity",
    "allocatable",
    "held",
    "claimed",
    "requested",
    "inferenceServices",
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    current: Sequence[Condition],
    generation: int,
    now: str,
) -> list[JSON]:
    """Render conditions, keeping lastTransitionTime while a condition's status holds."""
    before = {c.get("type"): c for c in previous}
    out: list[JSON] = []
    for cond in current:
        status = "True" if cond.status else "False"
        old = before.get(cond.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return out


def owned_status(status: Mapping[str, Any], fields: Sequence[str], types: Sequence[str]) -> JSON:
    """The part of a status that the operator writes, to compare with what it would write."""
    out: JSON = {key: status[key] for key in fields if key in status}
    conditions = [c for c in status.get("conditions") or () if c.get("type") in types]
    if conditions:
        out["conditions"] = conditions
    return out
