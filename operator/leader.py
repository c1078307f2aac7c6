"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

kopf's own peering pauses every instance that sees a peer of equal or higher priority, so two
identical replicas of one Deployment would both pause. A Lease gives exactly one active replica
with no extra CRD, and needs only get/create/update on one object in the operator's namespace.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from ladle.operator.api import JSON
from ladle.operator.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path

log = logging.getLogger("ladle.operator.leader")


def micro_time(now: datetime | None = None) -> str:
    """metav1.MicroTime, the format Lease timestamps use."""
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class ElectionTiming:
    # A standby takes over once the holder has not renewed for this long.
    lease_seconds: int = 15
    # The leader steps down if it could not renew for this long (< lease_seconds, so that it
    # stops before anybody else may start).
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0


class LeadershipLost(Exception):
    """The Lease could not be renewed within the renew deadline."""


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timing: ElectionTiming = ElectionTiming(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.identity = identity
        self.timing = timing
        self.path = resource_path("coordination.k8s.io/v1", "Lease", namespace, name)
        self._namespace = namespace
        self._name = name
        self._clock = clock
        # Like client-go, judge expiry by when *we* saw the record change, not by the
        # holder's clock: clocks of two nodes need not agree.
        self._observed: tuple[str | None, str | None] | None = None
        self._observed_at = 0.0
        self.is_leader = False

    async def try_acquire_or_renew(self) -> bool:
        lease = await self.client.get(self.path)
        now = micro_time()
        if lease is None:
            body: JSON = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self._name, "namespace": self._namespace},
                "spec": self._spec(now, now, 0),
            }
            try:
                await self.client.create(self.path.rsplit("/", 1)[0], body)
            except ApiError as err:
                if err.status == 409:
                    return False
                raise
            return True

        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        record = (holder, spec.get("renewTime"))
        if record != self._observed:
            self._observed = record
            self._observed_at = self._clock()
        duration = int(spec.get("leaseDurationSeconds") or self.timing.lease_seconds)
        if holder not in (None, self.identity) and (self._clock() < self._observed_at + duration):
            return False
        ours = holder == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        acquired = str(spec.get("acquireTime") or now) if ours else now
        lease["spec"] = self._spec(acquired, now, transitions)
        try:
            await self.client.replace(self.path, lease)
        except ApiError as err:
            if err.status == 409:  # somebody else wrote it first
                return False
            raise
        return True

    def _spec(self, acquired: str, renewed: str, transitions: int) -> JSON:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.timing.lease_seconds,
            "acquireTime": acquired,
            "renewTime": renewed,
            "leaseTransitions": transitions,
        }

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except REQUEST_ERRORS as err:
            log.warning("lease request failed", extra={"error": str(err)})
            return False

    async def acquire(self) -> None:
        """Return once this instance holds the Lease."""
        log.info("waiting for leadership", extra={"lease": self._name, "identity": self.identity})
        while not await self._attempt():
            await asyncio.sleep(self.timing.retry_seconds * (1 + random.random() * 0.2))
        self.is_leader = True
        log.info("became leader", extra={"lease": self._name, "identity": self.identity})

    async def hold(self) -> None:
        """Renew until a renewal misses the deadline, then raise LeadershipLost."""
        last_renewal = self._clock()
        while True:
            await asyncio.sleep(self.timing.retry_seconds)
            if await self._attempt():
                last_renewal = self._clock()
            elif self._clock() - last_renewal > self.timing.renew_deadline_seconds:
                self.is_leader = False
                log.error("lost leadership", extra={"lease": self._name})
                raise LeadershipLost(self._name)

    async def release(self) -> None:
        """Hand the Lease over at once on a clean shutdown, so a standby need not wait."""
        if not self.is_leader:
            return
        self.is_leader = False
        try:
            lease = await self.client.get(self.path)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = micro_time()
            lease["spec"] = {
                **lease["spec"],
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "renewTime": now,
            }
            await self.client.replace(self.path, lease)
            log.info("released leadership", extra={"lease": self._name})
        except REQUEST_ERRORS as err:
            log.warning("could not release the lease", extra={"error": str(err)})
