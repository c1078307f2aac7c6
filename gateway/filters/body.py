"""Body: read the request (its deadline, then the body, size-capped), parse what the gateway
routes by, then watch the client's side of the stream, so that a client hanging up cancels
the request wherever it is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.gateway.context import ClientRequest, Outcome, Receive, Send
from ladle.gateway.errors import GatewayError
from ladle.gateway.inbound import Inbound

CLIENT_CLOSED = "the client closed the connection"


@dataclass
class Body:
    max_size: int

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        req.deadline = client_deadline(req.header(b"x-ladle-timeout"), req.arrival)
        body = await self._read(req.receive, req.header(b"content-length"))
        content_type = req.header(b"content-type")
        req.parsed = Inbound.parse(
            body, None if content_type is None else content_type.decode("latin-1")
        )
        task = asyncio.current_task()
        receive = req.receive

        # A closure over what it needs and not over ``req``, which holds the watcher: a cycle
        # per request leaves each request's objects to the garbage collector (measured: 7%
        # fewer requests per second).
        async def watch_disconnect() -> None:
            """Cancel the request when the client hangs up before its answer is complete
            (after it, a hang-up, or the server's own http.disconnect, changes nothing)."""
            message = await receive()
            if message["type"] == "http.disconnect" and not out.complete and task is not None:
                out.error = CLIENT_CLOSED
                task.cancel()

        req.watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        if req.watcher is not None and not req.watcher.done():
            req.watcher.cancel()

    async def _read(self, receive: Receive, declared: bytes | None) -> bytes:
        limit = self.max_size
        too_large = GatewayError(
            413, f"the request body exceeds the {limit}-byte limit", "request_too_large"
        )
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        message = await receive()
        body = message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)
        parts = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
        return b"".join(parts)


def client_deadline(header: bytes | None, arrival: float) -> float:
    """``x-ladle-timeout``: the client's own deadline, if it sent one, else infinity."""
    if header is None:
        return float("inf")
    try:
        seconds = float(header)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e7:
        shown = header.decode(errors="replace")
        raise GatewayError(
            400,
            f"x-ladle-timeout must be a positive number of seconds, got {shown!r}",
            "invalid_timeout",
        )
    return arrival + seconds
