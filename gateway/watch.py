"""Informer-style caches of InferenceServices and runtime Pods, straight from the API server.

Each cache lists, then watches from the list's resourceVersion with bookmarks, and resumes from
the last version it saw when the server ends a watch cleanly. When the watch breaks (network,
API server restart) or the version has expired (410 Gone), it lists again and replaces its
whole content, so an object deleted during the gap disappears too. The gateway reads pods
directly rather than through a Service or EndpointSlices: it needs each pod's readiness and
address itself, and the local cluster has neither kube-proxy nor loopback EndpointSlices.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import aiohttp

from ladle.api import JSON
from ladle.kube import ApiError, KubeClient
from ladle.logs import Recurring

log = logging.getLogger("ladle.gateway.watch")

T = TypeVar("T")
WATCH_SECONDS = 290
_BACKOFF_MAX = 30.0


class _Expired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class Informer(Generic[T]):
    """Objects at ``path`` (optionally filtered by ``params``), parsed by ``parse`` (None
    means "not ours", dropped). ``on_change`` runs after every change, synchronously."""

    def __init__(
        self,
        api: KubeClient,
        path: str,
        parse: Callable[[JSON], T | None],
        on_change: Callable[[], None],
        params: Mapping[str, str] | None = None,
        name: str = "",
    ) -> None:
        self.api = api
        self.path = path
        self.parse = parse
        self.on_change = on_change
        self.params = dict(params or {})
        self.name = name or path
        self.items: dict[tuple[str, str], T] = {}
        self.synced = asyncio.Event()
        self.relists = 0
        # The last resourceVersion seen: a restarted run() resumes from it.
        self.version: str | None = None
        self._health = Recurring(
            log,
            "watch broke; listing again with backoff",
            "watching again",
            resource=self.name,
        )

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                if self.version is None:
                    self.version = await self._relist()
                await self._watch()
                failures = 0
            except _Expired:
                self.version = None
            except (ApiError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                failures += 1
                delay = min(_BACKOFF_MAX, 0.5 * 2 ** min(failures, 8)) * random.uniform(0.5, 1)
                self._health.failed(exc)
                self.version = None
                await asyncio.sleep(delay)

    async def _relist(self) -> str:
        objects, version = await self.api.list_at(self.path, self.params)
        fresh: dict[tuple[str, str], T] = {}
        for obj in objects:
            parsed = self._parse(obj)
            if parsed is not None:
                fresh[_key(obj)] = parsed
        self.items = fresh
        self.relists += 1
        self.synced.set()
        self.on_change()
        self._health.recovered()
        log.info("listed", extra={"resource": self.name, "objects": len(fresh)})
        return version

    async def _watch(self) -> None:
        """Follow events until the server ends the watch, keeping ``version`` current."""
        assert self.version is not None
        async for event in self.api.watch(self.path, self.params, self.version, WATCH_SECONDS):
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _Expired
                raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or obj))
            self.version = str((obj.get("metadata") or {}).get("resourceVersion") or self.version)
            if kind == "BOOKMARK":
                continue
            key = _key(obj)
            parsed = self._parse(obj) if kind != "DELETED" else None
            if parsed is None:
                if self.items.pop(key, None) is None:
                    continue
            else:
                self.items[key] = parsed
            self.on_change()

    def _parse(self, obj: JSON) -> T | None:
        try:
            return self.parse(obj)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning(
                "ignoring a malformed object", extra={"resource": self.name, "error": str(exc)}
            )
            return None


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
