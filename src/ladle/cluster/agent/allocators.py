"""Per-node allocators: one loopback address per pod, and fake GPU indices per container."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from ladle.words import plural


class Exhausted(Exception):
    """Nothing left to hand out."""


class AddressAllocator:
    """Pod IPs from the node's range, handed out round-robin so that a just-freed address (and
    a client's stale connection to it) is not reused at once."""

    def __init__(self, cidr: str) -> None:
        network = ipaddress.ip_network(cidr)
        # .0 names the range; the node itself has its own address outside it.
        self._pool = [str(ip) for ip in network.hosts()]
        self._used: set[str] = set()
        self._next = 0

    def reserve(self, ip: str) -> None:
        """Mark an address a running pod already holds (after an agent restart)."""
        self._used.add(ip)

    def allocate(self) -> str:
        for offset in range(len(self._pool)):
            index = (self._next + offset) % len(self._pool)
            ip = self._pool[index]
            if ip not in self._used:
                self._used.add(ip)
                self._next = index + 1
                return ip
        raise Exhausted("no pod addresses left on this node")

    def release(self, ip: str) -> None:
        self._used.discard(ip)


class GpuAllocator:
    """Device indices 0..n-1, owned by a (pod uid, container name) for the pod's lifetime, as
    the NVIDIA device plugin assigns them; the container sees ``CUDA_VISIBLE_DEVICES``."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._owner: dict[int, tuple[str, str]] = {}

    def reserve(self, owner: tuple[str, str], indices: Iterable[int]) -> None:
        for index in indices:
            self._owner[index] = owner

    def allocate(self, owner: tuple[str, str], count: int) -> list[int]:
        held = sorted(i for i, o in self._owner.items() if o == owner)
        if len(held) >= count:
            return held[:count]
        free = [i for i in range(self.count) if i not in self._owner]
        if len(free) < count - len(held):
            raise Exhausted(
                f"{plural(count, 'GPU')} requested but only {len(free) + len(held)} of "
                f"{self.count} are free"
            )
        chosen = free[: count - len(held)]
        self.reserve(owner, chosen)
        return sorted(held + chosen)

    def release(self, pod_uid: str) -> None:
        for index in [i for i, (uid, _) in self._owner.items() if uid == pod_uid]:
            del self._owner[index]
