"""A small asyncio client for the Kubernetes REST API: requests, and list-then-watch streams.

The agent authenticates with a client certificate from the cluster's CA. Plain REST over
aiohttp keeps the agent to one thread and one event loop, as the operator's client does.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

JSON = dict[str, Any]
PATCH_TYPES = {
    "strategic": "application/strategic-merge-patch+json",
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
}


class ApiError(Exception):
    """A non-2xx answer, carrying the API server's Status message."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


# What a call can fail with when the API server restarts or is slow; callers retry these.
TRANSIENT = (ApiError, aiohttp.ClientError, OSError, asyncio.TimeoutError)


class Kube:
    def __init__(self, server: str, ca_file: str, cert_file: str, key_file: str) -> None:
        context = ssl.create_default_context(cafile=ca_file)
        context.load_cert_chain(cert_file, key_file)
        self.server = server
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=32),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        timeout: float = 30,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        async with self._session.request(
            method,
            self.server + path,
            data=data,
            params=params,
            headers={"Content-Type": content_type, "Accept": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as rsp:
            text = await rsp.text()
            if rsp.status >= 400:
                raise _error(rsp.status, text)
            return json.loads(text) if text else None

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: JSON) -> Any:
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Any, kind: str = "strategic") -> Any:
        return await self.request("PATCH", path, body, content_type=PATCH_TYPES[kind])

    async def delete(self, path: str, body: JSON | None = None) -> Any:
        return await self.request("DELETE", path, body)

    async def watch(
        self, path: str, resource_version: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[tuple[str, JSON]]:
        """(type, object) events from ``resource_version`` on; bookmarks are passed through so
        the caller can advance its version. Ends when the server closes the stream."""
        query = {
            **(params or {}),
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "300",
        }
        async with self._session.get(
            self.server + path,
            params=query,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=330),
        ) as rsp:
            if rsp.status >= 400:
                raise _error(rsp.status, await rsp.text())
            async for line in rsp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired(obj.get("message", "resourceVersion too old"))
                    raise ApiError(int(obj.get("code", 500)), obj.get("message", ""))
                yield event["type"], obj


def _error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
        return ApiError(status, payload.get("message", text), payload.get("reason", ""))
    except (json.JSONDecodeError, AttributeError):
        return ApiError(status, text)
