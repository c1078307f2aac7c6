"""The kubelet's HTTPS endpoint, on each node's address and port 10250: what the API server
calls for ``kubectl logs``.

kube-apiserver reaches it through the Node's ``InternalIP`` and ``daemonEndpoints`` with its
kubelet client certificate (``--kubelet-client-certificate``) and checks this server's
certificate against the cluster CA (``--kubelet-certificate-authority``); this side accepts
only client certificates from that CA. Logs are plain files (no CRI timestamps), so
``timestamps``, ``sinceSeconds`` and ``sinceTime`` are refused with a 400 that says so, and
``exec``, ``attach`` and ``portForward`` answer 501.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from ladle.cluster.agent.pods import ContainerSupervisor, PodWorker

FOLLOW_POLL_SECONDS = 0.25
CHUNK = 64 * 1024

Finder = Callable[[str, str], PodWorker | None]


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message)


def tail_offset(path: Path, lines: int) -> int:
    """The byte offset where the last ``lines`` lines of the file start."""
    size = path.stat().st_size
    if lines <= 0:
        return size
    with path.open("rb") as handle:
        position = size
        found = 0
        block = 8192
        # A trailing newline ends the last line; it does not start another.
        handle.seek(max(size - 1, 0))
        if size and handle.read(1) == b"\n":
            position -= 1
        while position > 0:
            start = max(position - block, 0)
            handle.seek(start)
            data = handle.read(position - start)
            for index in range(len(data) - 1, -1, -1):
                if data[index : index + 1] == b"\n":
                    found += 1
                    if found == lines:
                        return start + index + 1
            position = start
    return 0


class KubeletServer:
    def __init__(self, find: Finder, ready: Callable[[], bool]) -> None:
        self.find = find
        self.ready = ready
        self.app = web.Application()
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self.logs)
        for verb in ("exec", "attach", "portForward", "run"):
            self.app.router.add_route("*", f"/{verb}/{{tail:.*}}", self.unsupported)
        self._runner: web.AppRunner | None = None

    async def start(self, hosts: list[str], port: int, context: ssl.SSLContext) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        for host in hosts:
            await web.TCPSite(self._runner, host, port, ssl_context=context).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        """200 once the agent has adopted what it found and runs its pods."""
        return _text(200, "ok") if self.ready() else _text(503, "starting")

    async def unsupported(self, request: web.Request) -> web.Response:
        return _text(501, f"{request.path.split('/')[1]} is not supported by the ladle node agent")

    async def logs(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        pod_name = request.match_info["pod"]
        name = request.match_info["container"]
        query = request.query
        for unsupported in ("timestamps", "sinceSeconds", "sinceTime"):
            if unsupported in query and query[unsupported] != "false":
                return _text(
                    400,
                    f"{unsupported} is not supported: the ladle node agent keeps container logs "
                    "as plain files, without per-line timestamps",
                )
        if query.get("stream", "All") != "All":
            return _text(400, "stdout and stderr share one log file on the ladle node agent")
        worker = self.find(namespace, pod_name)
        supervisor = worker.supervisors.get(name) if worker else None
        if worker is None or supervisor is None:
            return _text(404, f'container "{name}" in pod "{pod_name}" not found')
        previous = query.get("previous") == "true"
        view = supervisor.view
        # The kubelet's choice of instance (validateContainerLogStatus).
        if previous:
            if not view.last_state.get("terminated"):
                return _text(
                    400, f'previous terminated container "{name}" in pod "{pod_name}" not found'
                )
            restart = view.restart_count - 1
        elif "running" in view.state or "terminated" in view.state:
            restart = view.restart_count
        elif view.last_state.get("terminated"):
            restart = view.restart_count - 1  # restarting: the one that last ended
        else:
            reason = (view.state.get("waiting") or {}).get("reason", "ContainerCreating")
            return _text(
                400, f'container "{name}" in pod "{pod_name}" is waiting to start: {reason}'
            )
        path = supervisor.log_path(restart)
        if not path.is_file():
            return _text(400, f'container "{name}" in pod "{pod_name}" has no log yet')
        start = 0
        if "tailLines" in query:
            start = tail_offset(path, int(query["tailLines"]))
        limit = int(query["limitBytes"]) if "limitBytes" in query else None
        follow = query.get("follow") == "true" and not previous
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await self._stream(response, path, start, limit, follow, supervisor, restart)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        path: Path,
        offset: int,
        limit: int | None,
        follow: bool,
        supervisor: ContainerSupervisor,
        restart: int,
    ) -> None:
        sent = 0
        last_pass = not follow
        with path.open("rb") as handle:
            handle.seek(offset)
            while True:
                chunk = handle.read(CHUNK if limit is None else min(CHUNK, limit - sent))
                if chunk:
                    sent += len(chunk)
                    try:
                        await response.write(chunk)
                    except ConnectionResetError:
                        return
                    if limit is not None and sent >= limit:
                        return
                    continue
                if last_pass:
                    return
                if not (supervisor.running and supervisor.view.restart_count == restart):
                    last_pass = True  # it has exited: read what it wrote last, then stop
                    continue
                await asyncio.sleep(FOLLOW_POLL_SECONDS)


def server_context(cert: str, key: str, client_ca: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=client_ca)
    context.load_cert_chain(cert, key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context
