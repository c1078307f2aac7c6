"""The Kubernetes layer that the operator and the gateway share: one login and a thin asyncio
client (server-side apply, get, list, create, replace, delete).

In the operator kopf owns the watch streams and this client does the writes. It reuses kopf's
login (the same credentials kopf watches with) and speaks plain REST over aiohttp, so neither
component needs the ``kubernetes`` package nor threads.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml

from ladle.api import (
    API_VERSION,
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_KIND,
    HTTP_ROUTE_PLURAL,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    ISVC_KIND,
    JSON,
    MODEL_REWRITE_API_VERSION,
    MODEL_REWRITE_KIND,
    MODEL_REWRITE_PLURAL,
    POOL_KIND,
)
from ladle.flag_types import yaml_problem

# (apiVersion, kind) → (plural, namespaced), for every kind the operator touches.
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Node"): ("nodes", False),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("coordination.k8s.io/v1", "Lease"): ("leases", True),
    (API_VERSION, ISVC_KIND): ("inferenceservices", True),
    (API_VERSION, POOL_KIND): ("gpupools", False),
    (INFERENCE_POOL_API_VERSION, INFERENCE_POOL_KIND): (INFERENCE_POOL_PLURAL, True),
    (HTTP_ROUTE_API_VERSION, HTTP_ROUTE_KIND): (HTTP_ROUTE_PLURAL, True),
    (MODEL_REWRITE_API_VERSION, MODEL_REWRITE_KIND): (MODEL_REWRITE_PLURAL, True),
}

APPLY_PATCH = "application/apply-patch+yaml"


class ApiError(Exception):
    """A non-2xx answer, with the API server's own Status message."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class LoginError(kopf.LoginError):
    """No credentials, or a kubeconfig that cannot be used: the message says what to fix. A
    kopf LoginError, so that kopf's own login handling in the operator treats it as one."""


class Fenced(Exception):
    """A write refused or cut off because this instance may no longer act as the leader."""


# What a request can fail with; callers retry these rather than crash.
REQUEST_ERRORS = (ApiError, Fenced, aiohttp.ClientError, OSError, TimeoutError)
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def resource_path(
    api_version: str, kind: str, namespace: str | None = None, name: str | None = None
) -> str:
    plural, namespaced = RESOURCES[(api_version, kind)]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespaced and namespace else ""
    tail = f"/{name}" if name else ""
    return f"{base}{scope}/{plural}{tail}"


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def _absolute(value: Any, base: Path) -> Any:
    if isinstance(value, str) and value and not os.path.isabs(value):
        return str(base / value)
    return value


KUBECONFIG_HINT = 'set KUBECONFIG (for the local cluster: eval "$(ladle cluster env)")'


def login() -> kopf.ConnectionInfo:
    """In-cluster ServiceAccount first, then $KUBECONFIG / ~/.kube/config."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings)
    if info is not None:
        # kopf assumes cluster DNS (https://kubernetes.default.svc); like client-go, prefer
        # the address every pod is given in its environment.
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT")
        if host and port:
            host = f"[{host}]" if ":" in host else host
            info = dataclasses.replace(info, server=f"https://{host}:{port}")
        return info
    try:
        info = kopf.login_with_kubeconfig(settings=settings)
    except kopf.LoginError as err:  # "Current context is not set in kubeconfigs."
        raise LoginError(f"{str(err).rstrip('.')}; {KUBECONFIG_HINT}") from None
    except OSError as err:
        raise LoginError(
            f"cannot read the kubeconfig {err.filename}: {err.strerror} (check KUBECONFIG)"
        ) from None
    except yaml.YAMLError as err:
        raise LoginError(f"the kubeconfig is {yaml_problem(err)}; {KUBECONFIG_HINT}") from None
    except KeyError as err:
        raise LoginError(
            f"the kubeconfig names a context, cluster or user {err} that it does not define; "
            f"{KUBECONFIG_HINT}"
        ) from None
    except (TypeError, AttributeError):
        raise LoginError(
            f"the kubeconfig is not one (expected clusters, contexts and users); {KUBECONFIG_HINT}"
        ) from None
    if info is None:
        raise LoginError(f"no in-cluster ServiceAccount and no kubeconfig: {KUBECONFIG_HINT}")
    # kubeconfig file paths are relative to the kubeconfig itself; kopf passes them through.
    first = os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]
    base = Path(os.path.expanduser(first)).resolve().parent
    return dataclasses.replace(
        info,
        ca_path=_absolute(info.ca_path, base),
        certificate_path=_absolute(info.certificate_path, base),
        private_key_path=_absolute(info.private_key_path, base),
    )


class KubeClient:
    def __init__(
        self,
        field_manager: str,
        login_fn: Callable[[], kopf.ConnectionInfo] = login,
        timeout_seconds: float = 60.0,
        observe: Callable[[str, float], None] | None = None,
        fence: Callable[[], float] | None = None,
    ) -> None:
        self.field_manager = field_manager
        # Called with (HTTP method, seconds) after every request, for the latency metric.
        self._observe = observe
        # The time.monotonic() deadline for writes (the leader's term); none after it, and a
        # write still in flight at it is cut off.
        self._fence = fence
        self._login = login_fn
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._info = login_fn()
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._info.as_ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(
                base_url=self._info.server, connector=connector, timeout=self._timeout
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> JSON:
        data = None if body is None else json.dumps(body)
        started = time.perf_counter()
        try:
            if self._fence is None or method not in WRITES:
                return await self._send(method, path, params, data, content_type)
            left = self._fence() - time.monotonic()
            if left <= 0:
                raise Fenced(f"not the leader: {method} {path} not sent")
            try:
                async with asyncio.timeout(left):
                    return await self._send(method, path, params, data, content_type)
            except TimeoutError as err:
                raise Fenced(f"leadership ended during {method} {path}") from err
        finally:
            if self._observe is not None:
                self._observe(method, time.perf_counter() - started)

    async def _send(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        data: str | None,
        content_type: str,
    ) -> JSON:
        for attempt in (1, 2):
            headers = {"Accept": "application/json", **self._info.as_http_headers()}
            if data is not None:
                headers["Content-Type"] = content_type
            session = self._open()
            async with session.request(
                method, path, params=params, data=data, headers=headers
            ) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 1:
                    # Projected ServiceAccount tokens rotate; read the credentials again.
                    self._info = self._login()
                    continue
                if resp.status >= 400:
                    raise _api_error(resp.status, text)
                result: JSON = json.loads(text) if text else {}
                return result
        raise AssertionError("unreachable")

    async def apply(
        self,
        obj: Mapping[str, Any],
        *,
        subresource: str | None = None,
        force: bool = True,
        field_manager: str | None = None,
    ) -> JSON:
        """Server-side apply under the operator's field manager (or another of its own, for
        fields a separate loop owns); ``force`` takes over fields that other managers own,
        otherwise such a conflict is a 409."""
        path = object_path(obj) + (f"/{subresource}" if subresource else "")
        params = {
            "fieldManager": field_manager or self.field_manager,
            "force": str(force).lower(),
        }
        return await self.request("PATCH", path, params=params, body=obj, content_type=APPLY_PATCH)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> JSON:
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": self.field_manager},
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def json_patch(self, path: str, ops: Sequence[Mapping[str, Any]]) -> JSON:
        """An RFC 6902 patch: its ``test`` operations make a write conditional on values,
        where a resourceVersion would also refuse writes to unrelated fields."""
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": self.field_manager},
            body=list(ops),
            content_type="application/json-patch+json",
        )

    async def get(self, path: str) -> JSON | None:
        try:
            return await self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(self, path: str, params: Mapping[str, str] | None = None) -> list[JSON]:
        return (await self.list_at(path, params))[0]

    async def list_at(
        self, path: str, params: Mapping[str, str] | None = None
    ) -> tuple[builtins.list[JSON], str]:
        """Every object (paging through ``continue``) and the list's resourceVersion, where a
        watch of the same objects starts."""
        items: builtins.list[JSON] = []
        query = {**(params or {}), "limit": "500"}
        while True:
            page = await self.request("GET", path, params=query)
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
        headers = {"Accept": "application/json", **self._info.as_http_headers()}
        async with self._open().get(path, params=query, headers=headers, timeout=timeout) as resp:
            if resp.status == 401:
                self._info = self._login()  # for the next try: projected tokens rotate
            if resp.status >= 400:
                raise _api_error(resp.status, await resp.text())
            # One JSON event per line; lines may exceed aiohttp's readline limit (big pods).
            pending = b""
            async for data in resp.content.iter_any():
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    async def create(self, path: str, obj: Mapping[str, Any]) -> JSON:
        return await self.request(
            "POST", path, params={"fieldManager": self.field_manager}, body=obj
        )

    async def replace(self, path: str, obj: Mapping[str, Any]) -> JSON:
        return await self.request(
            "PUT", path, params={"fieldManager": self.field_manager}, body=obj
        )

    async def delete(self, path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            await self.request("DELETE", path)
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True


def _api_error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        return ApiError(status, text.strip()[:500])
    if not isinstance(payload, dict):
        return ApiError(status, text.strip()[:500])
    return ApiError(status, str(payload.get("message", "")), str(payload.get("reason", "")))
