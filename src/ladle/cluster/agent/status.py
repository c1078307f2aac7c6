"""A pod's status from its containers' states, as a pure function: phase, the four
conditions the kubelet owns, addresses and containerStatuses. The result is a strategic merge
patch: conditions merge by type (the scheduler's PodScheduled stays), container states carry
explicit nulls so that ``running`` replaces ``waiting`` instead of sitting beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]
STATE_KEYS = ("waiting", "running", "terminated")


@dataclass
class ContainerView:
    """What the status reports about one container."""

    name: str
    image: str
    image_id: str = ""
    container_id: str = ""
    restart_count: int = 0
    state: JSON = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: JSON = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    # Whether a terminated container will run again (restartPolicy, deletion).
    final: bool = False

    def json(self) -> JSON:
        state = {key: self.state.get(key) for key in STATE_KEYS}
        last = {key: self.last_state.get(key) for key in STATE_KEYS}
        status: JSON = {
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": last,
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def phase(containers: list[ContainerView]) -> str:
    """Pending until a container has run; Succeeded or Failed once all have stopped for good."""
    if containers and all("terminated" in c.state and c.final for c in containers):
        failed = any(c.state["terminated"].get("exitCode", 1) != 0 for c in containers)
        return "Failed" if failed else "Succeeded"
    if any("running" in c.state or c.restart_count > 0 or c.last_state for c in containers):
        return "Running"
    if any("terminated" in c.state for c in containers):
        return "Running"
    return "Pending"


def _done(view: ContainerView, sidecars: set[str]) -> bool:
    if view.name in sidecars:
        return view.started
    return view.final and (view.state.get("terminated") or {}).get("exitCode") == 0


def _condition(
    previous: dict[str, JSON], kind: str, ok: bool, now: str, reason: str = "", message: str = ""
) -> JSON:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    # Explicit nulls: a strategic merge patch would otherwise keep a stale reason on True.
    return {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": since,
        "reason": None if ok or not reason else reason,
        "message": None if ok or not reason else message,
    }


def pod_status(
    pod: JSON,
    containers: list[ContainerView],
    *,
    init_containers: list[ContainerView] | None = None,
    sidecars: set[str] | None = None,
    initialized: bool = True,
    pod_ip: str,
    host_ip: str,
    start_time: str,
    sandbox_ready: bool,
    now: str,
) -> JSON:
    previous = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    inits = init_containers or []
    # Sidecars (restartable init containers) count towards readiness like app containers.
    serving = [*(c for c in inits if c.name in (sidecars or set())), *containers]
    unready = [c.name for c in serving if not c.ready]
    all_ready = not unready and bool(containers) and initialized
    incomplete = [c.name for c in inits if not _done(c, sidecars or set())]
    failed_init = any(
        c.final and (c.state.get("terminated") or {}).get("exitCode", 0) != 0 for c in inits
    )
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    gates_ok = all(previous.get(gate, {}).get("status") == "True" for gate in gates)
    not_ready_message = f"containers with unready status: [{' '.join(unready)}]"
    ready_reason = "ContainersNotReady" if unready else "ReadinessGatesNotReady"
    status: JSON = {
        "phase": "Failed" if failed_init else phase(containers) if initialized else "Pending",
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": start_time,
        "observedGeneration": pod["metadata"].get("generation", 1),
        "conditions": [
            _condition(previous, "PodReadyToStartContainers", sandbox_ready, now),
            _condition(
                previous,
                "Initialized",
                initialized,
                now,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(incomplete)}]",
            ),
            _condition(
                previous, "ContainersReady", all_ready, now, "ContainersNotReady", not_ready_message
            ),
            _condition(
                previous,
                "Ready",
                all_ready and gates_ok,
                now,
                ready_reason,
                not_ready_message if unready else "the readiness gates are not all True",
            ),
        ],
        "containerStatuses": [c.json() for c in containers],
    }
    if inits:
        status["initContainerStatuses"] = [c.json() for c in inits]
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    return status
