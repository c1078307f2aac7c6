"""A deduplicating work queue with per-key backoff, in the manner of client-go's workqueue.

Watch events only say "look at this object again". However many events arrive for one key,
it waits in the queue at most once, and it is never reconciled by two workers at a time: an
event for a key in progress marks it dirty, and it is queued again when the worker is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, base_delay: float = 0.5, max_delay: float = 30.0) -> None:
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._failures: dict[K, int] = {}
        self._base = base_delay
        self._max = max_delay

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, key: K) -> None:
        """Queue now (an event supersedes any pending retry of the same key)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        if key in self._timers or key in self._queued:
            return
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def retry(self, key: K) -> float:
        """Requeue after an error with exponential backoff; return the delay."""
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        delay = min(self._base * 2.0 ** (failures - 1), self._max)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset the backoff of a key after a successful reconcile."""
        self._failures.pop(key, None)

    async def get(self) -> K:
        key = await self._queue.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
