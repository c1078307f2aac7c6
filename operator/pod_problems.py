"""Why runtime pods do not start or serve, read from what Kubernetes says about them: a
container's waiting reason, crash or OOM kill, the runtime's refusal of its settings (kept as
its termination message), the scheduler's words, and the kubelet's Warning Events for a pod
stuck in ContainerCreating. Which waits only someone's change can end (kstatus Stalled), and
when to read a waiting pod's Events, so that most pods cost no API call at all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ladle.api import parse_rfc3339
from ladle.words import plural

# Container waiting reasons that are part of a normal start. A pod whose volumes or sandbox
# cannot be set up also waits in one of them: the kubelet says why only in the pod's Events.
NORMAL_WAITS = frozenset({"ContainerCreating", "PodInitializing"})
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


def pod_problem(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending", "Running"):
        return None
    for cond in status.get("conditions") or ():
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return "Unschedulable", str(cond.get("message") or "unschedulable")
    init = status.get("initContainerStatuses") or ()
    for container in [*init, *(status.get("containerStatuses") or ())]:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason")
        if _oom_killed(container):
            return "OOMKilled", _oom_message(pod, container)
        if reason and reason not in NORMAL_WAITS:
            return str(reason), _with_refusal(str(waiting.get("message") or reason), container)
        if _crashed(container, init_container=container in init):
            return "CrashLoopBackOff", _with_refusal(_crash_message(container), container)
    return None


def refusal(status: Mapping[str, Any]) -> str | None:
    """The runtime's own words, if its last run ended refusing its settings."""
    for container in status.get("containerStatuses") or ():
        for state in (container.get("state") or {}, container.get("lastState") or {}):
            terminated = state.get("terminated") or {}
            if terminated.get("exitCode") == os.EX_CONFIG:
                return _last_error(str(terminated.get("message") or "")) or "settings refused"
    return None


def _last_error(said: str) -> str | None:
    """The last error line of Ladle's JSON logs in a termination message."""
    for line in reversed(said.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") == "error":
            return str(record.get("error") or record.get("message"))
    return None


def _with_refusal(message: str, container: Mapping[str, Any]) -> str:
    """``message``, and what the container said last before it exited, when that was an error
    line of Ladle's JSON logs (the runtime refusing a setting: a tensor-parallel size the
    model's heads do not split into), kept by the kubelet as its termination message."""
    said = ""
    for state in (container.get("state") or {}, container.get("lastState") or {}):
        said = said or str((state.get("terminated") or {}).get("message") or "")
    error = _last_error(said)
    return message if error is None else f"{message}: {error}"


def _crashed(container: Mapping[str, Any], *, init_container: bool) -> bool:
    """The container's run ended in a pod that goes on: the kubelet restarts it, after a
    back-off, and meanwhile (1.37 does) reports it terminated rather than waiting in
    CrashLoopBackOff. An init container's successful end is its job done."""
    terminated = (container.get("state") or {}).get("terminated")
    if terminated is None:
        return False
    return not init_container or terminated.get("exitCode") != 0


def _crash_message(container: Mapping[str, Any]) -> str:
    terminated = (container.get("state") or {}).get("terminated") or {}
    restarts = plural(int(container.get("restartCount") or 0), "restart")
    why = terminated.get("reason") or "Error"
    return (
        f"container {container.get('name')} exited with code {terminated.get('exitCode')} "
        f"({why}), {restarts} so far"
    )


def _oom_killed(container: Mapping[str, Any]) -> bool:
    """The kernel killed the container for exceeding its memory limit: its run now, or the
    last one while the kubelet backs off from restarting it."""
    state = container.get("state") or {}
    if (state.get("terminated") or {}).get("reason") == "OOMKilled":
        return True
    last = (container.get("lastState") or {}).get("terminated") or {}
    return (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff" and (
        last.get("reason") == "OOMKilled"
    )


def _oom_message(pod: Mapping[str, Any], container: Mapping[str, Any]) -> str:
    """What an OOM loop means for a runtime pod, and what to change: the limit is the service's
    ``resources.memory``, and the engine's KV cache is most of what it holds."""
    name = container.get("name")
    limit = next(
        (
            ((spec.get("resources") or {}).get("limits") or {}).get("memory")
            for spec in (pod.get("spec") or {}).get("containers") or ()
            if spec.get("name") == name
        ),
        None,
    )
    within = f"its memory limit ({limit})" if limit else "the node's memory"
    restarts = plural(int(container.get("restartCount") or 0), "restart")
    return (
        f"container {name} was killed by the kernel for exceeding {within}, {restarts} so "
        "far: raise resources.memory, or lower engine.kvCacheMemory or engine.maxNumSeqs"
    )


def starting_since(pod: Mapping[str, Any]) -> float | None:
    """When a pod bound to a node began waiting to start, if no container of it has started
    (the kubelet's startTime; the binding or creation time before the kubelet reports)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if not (pod.get("spec") or {}).get("nodeName") or status.get("phase") not in (None, "Pending"):
        return None
    for container in [
        *(status.get("initContainerStatuses") or ()),
        *(status.get("containerStatuses") or ()),
    ]:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting is None or waiting.get("reason") not in NORMAL_WAITS:
            return None  # it runs or ran, or waits for another reason (a problem of its own)
    scheduled = next(
        (
            c.get("lastTransitionTime")
            for c in status.get("conditions") or ()
            if c.get("type") == "PodScheduled" and c.get("status") == "True"
        ),
        None,
    )
    for stamp in (status.get("startTime"), scheduled, meta.get("creationTimestamp")):
        since = parse_rfc3339(stamp)
        if since is not None:
            return since
    return None
