"""The gateway's Kubernetes access: list, watch (as a stream of events) and status apply.

Credentials come from the same login as the operator's (in-cluster ServiceAccount, else
$KUBECONFIG), re-read on a 401 because projected tokens rotate. Plain REST over aiohttp.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from ladle.operator.kube import APPLY_PATCH, ApiError, login

JSON = dict[str, Any]


class KubeApi:
    def __init__(self, field_manager: str) -> None:
        self.field_manager = field_manager
        self._info = login()
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=16)
            self._session = aiohttp.ClientSession(base_url=self._info.server, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json", **self._info.as_http_headers()}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 401:
            self._info = login()
        if resp.status >= 400:
            text = await resp.text()
            try:
                message = str(json.loads(text).get("message", text))
            except (ValueError, AttributeError):
                message = text[:500]
            raise ApiError(resp.status, message)

    async def list(self, path: str, params: Mapping[str, str]) -> tuple[list[JSON], str]:
        """Every object (paging through ``continue``) and the list's resourceVersion."""
        items: list[JSON] = []
        query = {**params, "limit": "500"}
        timeout = aiohttp.ClientTimeout(total=60)
        while True:
            async with self._open().get(
                path, params=query, headers=self._headers(), timeout=timeout
            ) as resp:
                await self._check(resp)
                page = await resp.json()
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion") or "")
            query["continue"] = meta["continue"]

    async def watch(
        self, path: str, params: Mapping[str, str], resource_version: str, timeout_seconds: int
    ) -> AsyncIterator[JSON]:
        """Watch events from ``resource_version`` until the server ends the watch."""
        query = {
            **params,
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        # No read timeout of our own beyond the server's, plus slack for a silent connection.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        async with self._open().get(
            path, params=query, headers=self._headers(), timeout=timeout
        ) as resp:
            await self._check(resp)
            # One JSON event per line; lines may exceed aiohttp's readline limit (big pods).
            pending = b""
            async for data in resp.content.iter_any():
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    async def apply_status(self, path: str, body: JSON) -> None:
        """Server-side apply ``body`` to the status subresource at ``path``."""
        params = {"fieldManager": self.field_manager, "force": "true"}
        async with self._open().patch(
            path + "/status",
            params=params,
            data=json.dumps(body),
            headers=self._headers(APPLY_PATCH),
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            await self._check(resp)
