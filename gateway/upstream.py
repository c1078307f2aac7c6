"""A pooled HTTP/1.1 client for the pods, on httptools (the parser uvicorn uses).

It does exactly what the proxy needs and nothing else, which made it about 1.5x faster than
aiohttp's client on one core (docs/gateway.md has the measurement): keep-alive connections per
pod, one write per request, response headers as soon as they are parsed, body pieces as they
arrive with flow control toward slow clients, and errors that say whether the pod could have
started the work. Deadlines are absolute ``loop.time()`` values, enforced with timer handles
rather than ``asyncio.wait_for`` (which would cost a task per wait).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import cast

import httptools

Headers = Sequence[tuple[bytes, bytes]]

# A pod's server (uvicorn) closes idle keep-alive connections after 5 s; leave them earlier.
IDLE_SECONDS = 4.0
MAX_IDLE_PER_POD = 256
# Stop reading from the pod while this many body pieces wait for a slow client.
_PAUSE_AT = 64
_RESUME_AT = 16


class UpstreamError(Exception):
    """The exchange with the pod failed. ``sent`` says whether the request reached it."""

    kind = "reset"

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class ConnectError(UpstreamError):
    kind = "connect_error"


class UpstreamTimeout(UpstreamError):
    kind = "timeout"


class StaleConnection(UpstreamError):
    """A pooled connection turned out closed before any answer: retry on a fresh one."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.items: collections.deque[bytes] = collections.deque()
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.error: UpstreamError | None = None
        self.answered = False  # any byte of a response arrived
        self.waiter: asyncio.Future[None] | None = None

    # -- protocol callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if not self.complete and self.error is None:
            if self.reused and not self.answered:
                self.error = StaleConnection("the pooled connection was closed")
            else:
                self.error = UpstreamError(f"the pod closed the connection ({exc or 'EOF'})")
            self._wake()

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = UpstreamError(f"malformed response from the pod: {exc}")
            self._wake()
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Asked now: once the message is complete the parser has moved on to the next one.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.items.append(body)
        if len(self.items) >= _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- used by Response -----------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, deadline: float | None, what: str) -> None:
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = None
        if deadline is not None:
            timer = loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            raise UpstreamTimeout(f"no {what} from the pod in time", sent=True) from None
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Response:
    """An answer whose headers have arrived; the body is read piece by piece."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self, deadline: float | None = None) -> bytes | None:
        """The next body piece, or None at the end of the body."""
        conn = self._conn
        while True:
            if conn.items:
                piece = conn.items.popleft()
                if conn.paused and len(conn.items) <= _RESUME_AT and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                return piece
            if conn.complete:
                self.release()
                return None
            if conn.error is not None:
                raise conn.error
            await conn.wait(deadline, "response body")

    async def read_all(self, deadline: float | None = None) -> bytes:
        parts = []
        while (piece := await self.read(deadline)) is not None:
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back if the exchange finished cleanly, else close it."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.complete and not conn.closed and conn.keep_alive:
            conn.pool._put(conn)
        else:
            conn.abort()


class Pool:
    """Idle keep-alive connections per pod address."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def request(
        self,
        host: str,
        port: int,
        method: bytes,
        path: bytes,
        headers: Headers,
        body: bytes,
        deadline: float | None = None,
    ) -> Response:
        """Send one request and wait for the response headers (not the body)."""
        try:
            return await self._exchange(host, port, method, path, headers, body, deadline)
        except StaleConnection:
            # The pod had closed an idle connection just as it was reused; nothing was done.
            return await self._exchange(
                host, port, method, path, headers, body, deadline, fresh=True
            )

    async def _exchange(
        self,
        host: str,
        port: int,
        method: bytes,
        path: bytes,
        headers: Headers,
        body: bytes,
        deadline: float | None,
        fresh: bool = False,
    ) -> Response:
        conn = None if fresh else self._take((host, port))
        if conn is None:
            conn = await self._connect(host, port, deadline)
        conn._reset()
        head = [b"%s %s HTTP/1.1\r\nhost: %s:%d\r\n" % (method, path, host.encode(), port)]
        head.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        assert conn.transport is not None
        conn.transport.write(b"".join(head) + body)
        try:
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(deadline, "response")
        except BaseException:
            conn.abort()
            raise
        return Response(conn)

    async def _connect(self, host: str, port: int, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout
        if deadline is not None:
            timeout = min(timeout, max(deadline - loop.time(), 0.001))
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, (host, port)), host, port),
                timeout,
            )
        except TimeoutError:
            raise ConnectError(f"connecting to {host}:{port} timed out", sent=False) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}", sent=False) from None
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_SECONDS:
                conn.reused = True
                return conn
            conn.abort()
        return None

    def _put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE_PER_POD:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def drop(self, host: str, port: int) -> None:
        """Close the idle connections to a pod that went away."""
        for conn in self._idle.pop((host, port), []):
            conn.abort()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
