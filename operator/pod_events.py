"""What pods' Events add to their status: the kubelet's reason a pod stuck in
ContainerCreating cannot start (a volume, a sandbox), and the scheduler's latest reasoning for
an unschedulable one. Read only for the pods that need it, one small filtered list each."""

from __future__ import annotations

from ladle.kube import KubeClient, resource_path
from ladle.operator.pod_problems import PodProblem, start_failure, startup_look
from ladle.operator.store import PodInfo


class PodEvents:
    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def problems(
        self, namespace: str, pods: list[PodInfo], now: float
    ) -> tuple[list[PodProblem], float | None]:
        """The pods' own reasons; and when to read the Events of those waiting to start."""
        problems = [PodProblem(p.name, *p.problem) for p in pods if p.problem is not None]
        look = startup_look(
            {p.name: p.starting_since for p in pods if p.starting_since is not None}, now
        )
        for pod in look.pods:
            # A volume or sandbox failure is only in the pod's Events (its status says
            # ContainerCreating): one small list per waiting pod, filtered by the API server.
            events = await self.client.list(
                resource_path("v1", "Event", namespace),
                {"fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={pod}"},
            )
            failure = start_failure(events)
            if failure is not None:
                problems.append(PodProblem(pod, *failure))
        return await self._scheduler_words(namespace, problems), look.wake_in

    async def _scheduler_words(
        self, namespace: str, problems: list[PodProblem]
    ) -> list[PodProblem]:
        """Unschedulable pods in the scheduler's latest words (its reasoning is in Events)."""
        unschedulable = {p.pod for p in problems if p.reason == "Unschedulable"}
        if not unschedulable:
            return problems
        # The scheduler's FailedScheduling events carry its reasoning; the pod condition
        # holds the same text and stands in when events have expired.
        events = await self.client.list(
            resource_path("v1", "Event", namespace),
            {"fieldSelector": "involvedObject.kind=Pod,reason=FailedScheduling"},
        )
        latest: dict[str, tuple[str, str]] = {}
        for event in events:
            pod = str((event.get("involvedObject") or {}).get("name"))
            when = str(
                event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
            )
            if pod in unschedulable and (pod not in latest or when >= latest[pod][0]):
                latest[pod] = (when, str(event.get("message") or ""))
        return [
            PodProblem(p.pod, p.reason, latest[p.pod][1] or p.message) if p.pod in latest else p
            for p in problems
        ]
