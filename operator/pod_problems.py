"""Why runtime pods do not start or serve, read from what Kubernetes says about them: a
container's waiting reason, the scheduler's words, and the kubelet's Warning Events for a pod
stuck in ContainerCreating. Which waits only someone's change can end (kstatus Stalled), and
when to read a waiting pod's Events, so that most pods cost no API call at all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ladle.api import parse_rfc3339

# Container waiting reasons that need a change by someone (a Secret or ConfigMap to create, an
# image name to fix, a memory limit the engine does not fit in); others (an image pull, a
# crash loop) may pass and stall only at the Deployment's progress deadline.
STALLING_WAITS = frozenset({"CreateContainerConfigError", "InvalidImageName", "OOMKilled"})

# Warning Events by which the kubelet (or the attach/detach controller) says why a pod it
# accepted cannot leave ContainerCreating: a volume it cannot attach, map or mount (a missing
# Secret or ConfigMap, a claim's volume that will not attach), or a sandbox it cannot create.
# The pod's status says only ContainerCreating meanwhile. Preferred in this order when several
# hold at once.
START_FAILURE_EVENTS = (
    "FailedMount",
    "FailedAttachVolume",
    "FailedMapVolume",
    "FailedCreatePodSandBox",
)
# Events a pod posts once it is past its volumes and sandbox: older failures no longer hold.
START_PROGRESS_EVENTS = frozenset({"Pulling", "Pulled", "Created", "Started"})
# After two minutes the kubelet adds this summary of the mounts it is still waiting for; the
# SetUp failure it keeps reporting names the missing object, so that one is preferred.
MOUNT_TIMEOUT_PREFIX = "Unable to attach or mount volumes"
# A pod may take this long to start before its Events are read: most start sooner, and cost
# no API call at all.
STARTUP_GRACE_SECONDS = 5.0
# Then its Events are read again every half of its wait so far, within these bounds, for as
# long as it waits (a failure may resolve while an image pull keeps it ContainerCreating).
STARTUP_RECHECK_SECONDS = (5.0, 60.0)
# Pods read per variant and reconcile, the longest waiting first: they share one template.
STARTUP_LOOKUPS = 3


@dataclass(frozen=True)
class PodProblem:
    """Why one runtime pod does not serve: the scheduler's words, or its container's."""

    pod: str
    # "Unschedulable", or a container's waiting reason such as CreateContainerConfigError.
    reason: str
    message: str


@dataclass(frozen=True)
class StartupLook:
    """Which waiting pods to read the Events of now, and when to look again."""

    pods: tuple[str, ...]
    wake_in: float | None


def startup_look(waiting: Mapping[str, float], now: float) -> StartupLook:
    """For pods waiting to start (name → since when, seconds since the epoch): those past the
    grace period, the longest waiting first, and the soonest moment another look is due."""
    due = sorted(
        (since, name) for name, since in waiting.items() if now - since >= STARTUP_GRACE_SECONDS
    )
    low, high = STARTUP_RECHECK_SECONDS
    wakes = [
        STARTUP_GRACE_SECONDS - (now - since)
        if now - since < STARTUP_GRACE_SECONDS
        else min(max((now - since) / 2, low), high)
        for since in waiting.values()
    ]
    return StartupLook(
        tuple(name for _, name in due[:STARTUP_LOOKUPS]), min(wakes) if wakes else None
    )


def _event_time(event: Mapping[str, Any]) -> float:
    series = event.get("series") or {}
    for stamp in (
        series.get("lastObservedTime"),
        event.get("lastTimestamp"),
        event.get("eventTime"),
        event.get("firstTimestamp"),
    ):
        when = parse_rfc3339(stamp)
        if when is not None:
            return when
    return 0.0


def start_failure(events: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """Why a pod cannot start, in its own Events: a volume or sandbox failure (reason and the
    kubelet's message) that no later event of its progress has superseded."""
    progress = max(
        (_event_time(e) for e in events if e.get("reason") in START_PROGRESS_EVENTS),
        default=None,
    )
    current = [
        e
        for e in events
        if e.get("type") == "Warning"
        and e.get("reason") in START_FAILURE_EVENTS
        and (progress is None or _event_time(e) > progress)
    ]
    if not current:
        return None
    best = min(
        current,
        key=lambda e: (
            START_FAILURE_EVENTS.index(str(e.get("reason"))),
            str(e.get("message") or "").startswith(MOUNT_TIMEOUT_PREFIX),
            -_event_time(e),
        ),
    )
    reason = str(best.get("reason"))
    return reason, str(best.get("message") or reason)


def needs_someone(reason: str, message: str) -> bool:
    """A wait that only a change by someone ends: a Secret or ConfigMap to create (whether the
    pod reads it as environment or mounts it), an image name to fix."""
    if reason in STALLING_WAITS:
        return True
    return reason in START_FAILURE_EVENTS and " not found" in message


# How many nodes the scheduler found short of each resource ("3 Insufficient nvidia.com/gpu,
# 1 Insufficient cpu."). GPUs are the reason only when more nodes lack them than lack anything
# else: a pod that no node fits for its CPUs stays Unschedulable however busy the GPUs are.
INSUFFICIENT = re.compile(r"(\d+) Insufficient ([^\s,]+?)[.,]?(?=\s|$)")


def short_of_gpus(messages: Sequence[str], gpu_resource: str) -> bool:
    short: dict[str, int] = {}
    for message in messages:
        for count, resource in INSUFFICIENT.findall(message):
            short[resource] = max(short.get(resource, 0), int(count))
    gpus = short.pop(gpu_resource, 0)
    return gpus > 0 and all(gpus > n for n in short.values())
