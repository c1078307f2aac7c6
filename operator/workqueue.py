"""A deduplicating work queue with two lanes and per-key backoff, after client-go's workqueue.

Watch events only say "look at this object again". However many events arrive for one key,
it waits in the queue at most once, and it is never reconciled by two workers at a time: an
event for a key in progress marks it dirty, and it is queued again when the worker is done.

Keys in the urgent lane go first. The controller puts spec changes there, so that a new or
edited InferenceService is not stuck behind hundreds of status refreshes of others.

A key that failed waits out its backoff whatever events arrive meanwhile (the retry is level-
based, so it sees them all), except an urgent one: a spec change may be the fix, so it is
tried at once (the failure count stays, so a fix that fails too waits longer next time).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

URGENT = 0
NORMAL = 1


class WorkQueue(Generic[K]):
    def __init__(
        self,
        base_delay: float = 0.5,
        max_delay: float = 30.0,
        on_wait: Callable[[bool, float], None] | None = None,
    ) -> None:
        self._lanes: tuple[deque[K], deque[K]] = (deque(), deque())
        # Queued key → its lane. A key that moved up leaves a stale entry behind, skipped later.
        self._queued: dict[K, int] = {}
        self._added = asyncio.Event()
        self._processing: set[K] = set()
        self._dirty: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        # Keys waiting out a failure's backoff (their timer is in _timers).
        self._backing_off: set[K] = set()
        self._failures: dict[K, int] = {}
        self._base = base_delay
        self._max = max_delay
        # When each queued key was first queued, to report (urgent, seconds waited) on get.
        self._since: dict[K, float] = {}
        self._on_wait = on_wait

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, key: K, urgent: bool = False) -> None:
        """Queue now, unless the key is backing off from a failure and this is not urgent."""
        lane = URGENT if urgent else NORMAL
        if key in self._backing_off and not urgent:
            return
        self._backing_off.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if key in self._processing:
            self._dirty[key] = min(lane, self._dirty.get(key, NORMAL))
            return
        current = self._queued.get(key)
        if current is None:
            self._since[key] = time.monotonic()
            self._queued[key] = lane
            self._lanes[lane].append(key)
            self._added.set()
        elif lane < current:
            self._queued[key] = lane
            self._lanes[lane].append(key)
            self._added.set()

    def add_after(self, key: K, delay: float) -> None:
        """Queue after ``delay``. The soonest wake wins (as client-go's AddAfter): a later one
        set before must not hold back a pod that wants another look in seconds. A failure's
        backoff is never cut short."""
        if key in self._queued or key in self._backing_off:
            return
        loop = asyncio.get_running_loop()
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= loop.time() + delay:
                return
            timer.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self._backing_off.discard(key)
        self.add(key)

    def backoff(self, failures: int) -> float:
        """The delay before the next try after ``failures`` failures in a row."""
        return min(self._base * 2.0 ** (failures - 1), self._max)

    def retry(self, key: K) -> float:
        """Requeue after an error with exponential backoff; return the delay."""
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        delay = self.backoff(failures)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if self._dirty.get(key) == NORMAL:
            del self._dirty[key]  # events during the failed try wait for the retry too
        self._backing_off.add(key)
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._fire, key)
        return delay

    def forget(self, key: K) -> None:
        """Reset the backoff of a key after a successful reconcile, or once it is gone."""
        self._failures.pop(key, None)

    async def get(self, urgent_only: bool = False) -> K:
        """The next key, urgent ones first; ``urgent_only`` workers leave the rest alone, so
        that spec changes find a free worker however long the status backlog is."""
        lanes = (URGENT,) if urgent_only else (URGENT, NORMAL)
        while True:
            for lane in lanes:
                entries = self._lanes[lane]
                while entries:
                    key = entries.popleft()
                    if self._queued.get(key) != lane:
                        continue  # it moved to the urgent lane, or was taken
                    del self._queued[key]
                    self._processing.add(key)
                    since = self._since.pop(key)
                    if self._on_wait is not None:
                        self._on_wait(lane == URGENT, time.monotonic() - since)
                    return key
            self._added.clear()
            await self._added.wait()

    def done(self, key: K) -> None:
        self._processing.discard(key)
        lane = self._dirty.pop(key, None)
        if lane is not None:
            self.add(key, urgent=lane == URGENT)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._backing_off.clear()
