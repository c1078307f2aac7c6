"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

kopf's own peering pauses every instance that sees a peer of equal or higher priority, so two
identical replicas of one Deployment would both pause. A Lease gives exactly one active replica
with no extra CRD, and needs only get/create/update on one object in the operator's namespace.

Two leaders must never act at once. A standby takes the Lease ``lease_seconds`` after it last
saw it change; the leader may act only until ``renew_deadline_seconds`` after it *sent* its last
successful renewal, a moment no later than any standby's observation. ``valid_until`` is that
moment, and it holds whatever the network does: every renewal attempt is cut off when it
would pass it, ``hold`` returns at it rather than after a request that may hang, and the
client refuses writes at and after it (``KubeClient(fence=...)``). The gap between the two
durations (5 s by default) is the margin for writes already on the wire.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ladle.api import JSON, rfc3339
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.logs import Recurring

log = logging.getLogger("ladle.operator.leader")


@dataclass(frozen=True)
class ElectionTiming:
    # A standby takes over once the holder has not renewed for this long.
    lease_seconds: int = 15
    # The leader stops acting this long after its last successful renewal was sent (<
    # lease_seconds, so that it stops before anybody else may start).
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs retry period < renew deadline < lease duration, got "
                f"{self.retry_seconds:g} s, {self.renew_deadline_seconds:g} s and "
                f"{self.lease_seconds} s"
            )

    @property
    def attempt_seconds(self) -> float:
        """The longest one acquire or renew attempt may take: half the renew deadline, so
        that a hung request leaves room for another try before the deadline."""
        return self.renew_deadline_seconds / 2


class LeadershipLost(Exception):
    """The Lease could not be renewed within the renew deadline."""


class LeaseNamespaceMissing(Exception):
    """The Lease's namespace does not exist, so no replica can ever lead."""


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
        self._requests = Recurring(
            log, "lease requests failing; retrying", "lease requests succeed again", lease=name
        )
        # Like client-go, judge expiry by when *we* saw the record change, not by the
        # holder's clock: clocks of two nodes need not agree.
        self._observed: tuple[str | None, str | None] | None = None
        self._observed_at = 0.0
        # The monotonic time until which this instance may act as the leader.
        self.valid_until = float("-inf")

    @property
    def is_leader(self) -> bool:
        return self._clock() < self.valid_until

    def fence(self) -> float:
        """The deadline for writes (for ``KubeClient``): until the leadership may be lost."""
        return self.valid_until

    async def try_acquire_or_renew(self) -> bool:
        lease = await self.client.get(self.path)
        now = rfc3339(digits=6)
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
                if err.status == 404 and "namespaces" in err.message:
                    raise LeaseNamespaceMissing(self._namespace) from err
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

    async def _attempt(self, limit: float) -> bool:
        """One bounded try; on success, extend ``valid_until`` from when the try began."""
        started = self._clock()
        try:
            async with asyncio.timeout(max(limit, 0.0)):
                won = await self.try_acquire_or_renew()
        except TimeoutError:
            self._requests.failed(f"timed out after {limit:.2g} s")
            return False
        except REQUEST_ERRORS as err:
            self._requests.failed(err)
            return False
        self._requests.recovered()
        if won:
            self.valid_until = started + self.timing.renew_deadline_seconds
        return won

    async def acquire(self) -> None:
        """Return once this instance holds the Lease."""
        log.info("waiting for leadership", extra={"lease": self._name, "identity": self.identity})
        while not await self._attempt(self.timing.attempt_seconds):
            await asyncio.sleep(self.timing.retry_seconds * (1 + random.random() * 0.2))
        log.info("became leader", extra={"lease": self._name, "identity": self.identity})

    async def hold(self) -> None:
        """Renew every retry period; raise LeadershipLost the moment ``valid_until`` passes,
        whether or not a renewal is still in flight."""
        while True:
            left = self.valid_until - self._clock()
            if left <= 0:
                break
            await asyncio.sleep(min(self.timing.retry_seconds, left))
            left = self.valid_until - self._clock()
            if left <= 0:
                break
            await self._attempt(min(self.timing.attempt_seconds, left))
        log.error("lost leadership", extra={"lease": self._name, "identity": self.identity})
        raise LeadershipLost(self._name)

    async def release(self) -> None:
        """Hand the Lease over at once on a clean shutdown, so a standby need not wait."""
        if not self.is_leader:
            return
        self.valid_until = float("-inf")
        try:
            async with asyncio.timeout(self.timing.attempt_seconds):
                lease = await self.client.get(self.path)
                if (
                    lease is None
                    or (lease.get("spec") or {}).get("holderIdentity") != self.identity
                ):
                    return
                now = rfc3339(digits=6)
                lease["spec"] = {
                    **lease["spec"],
                    "holderIdentity": "",
                    "leaseDurationSeconds": 1,
                    "renewTime": now,
                }
                await self.client.replace(self.path, lease)
            log.info("released leadership", extra={"lease": self._name})
        except (TimeoutError, *REQUEST_ERRORS) as err:
            log.warning("could not release the lease", extra={"error": str(err)})
