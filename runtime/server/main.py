"""``ladle serve``: uvicorn around the app, with SIGTERM turned into a drain."""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import prometheus_client
import uvicorn

from ladle import logs
from ladle.runtime.async_engine import AsyncLLM
from ladle.runtime.config import EngineArgs
from ladle.runtime.limits import RequestLimits
from ladle.runtime.server.app import create_app
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.settings import ServerSettings

# After the drain, uvicorn's own shutdown only closes idle connections; bound it anyway.
_SHUTDOWN_GRACE_SECONDS = 5


class _DrainingServer(uvicorn.Server):
    """The first SIGTERM or SIGINT drains, then exits 0; a second one exits at once.

    uvicorn's handler would stop accepting connections immediately and re-raise the signal on
    the way out (so the exit status would be the signal's); Kubernetes still routes traffic
    here for a moment after SIGTERM, and those requests deserve a 503, not a refused connection.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def request_exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None:
            self.should_exit = True
            self.force_exit = self._drain is not None
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.state.drain()
        self.should_exit = True


def serve(
    settings: ServerSettings, engine_args: EngineArgs, limits: RequestLimits, sock: socket.socket
) -> int:
    """Serve on ``sock``, bound by the caller before torch loads (``ladle.listen``)."""
    logs.configure(settings.log_level)
    # vLLM does the same: ``*_created`` series double the scrape size and nobody reads them.
    prometheus_client.disable_created_metrics()
    state = ServerState(settings, lambda: AsyncLLM.from_engine_args(engine_args, limits))
    config = uvicorn.Config(
        create_app(state),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_SECONDS,
    )
    server = _DrainingServer(config, state)
    state.request_exit = server.request_exit
    server.run(sockets=[sock])
    return state.exit_code
