"""A pod's reply on its way to the client: server-sent events forwarded whole (so that a stream
cut short still ends in a clean error event), the tokens of its usage counted for the limits
and the metrics, and the body drained afterwards so that the connection can be reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any

from ladle.gateway.context import Outcome, Send
from ladle.gateway.errors import GatewayError, sse_error
from ladle.gateway.upstream import Response, UpstreamError, UpstreamTimeout

_USAGE = re.compile(rb'"usage":\s*\{')
# The OpenAI stream's last event.
_DONE = b"data: [DONE]\n\n"
# Seconds a pod has to end its body once the client's reply is complete.
_DRAIN = 1.0


async def relay_events(
    response: Response,
    first: bytes | None,
    deadline: float,
    send: Send,
    out: Outcome,
    *,
    expired: GatewayError,
    strip_usage: bool,
    count_usage: bool,
) -> str | None:
    """Forward server-sent events whole, so that a stream cut short can still end with a clean
    error event. Returns the failure kind when the stream could not be finished."""
    buffered = b""
    piece = first
    failure: str | None = None
    while True:
        if piece is None:
            break
        buffered += piece
        end = buffered.rfind(b"\n\n")
        if end >= 0:
            ready, buffered = buffered[: end + 2], buffered[end + 2 :]
            if count_usage and _USAGE.search(ready):
                ready = take_usage(ready, out, strip_usage)
            if ready:
                if out.captured is not None:
                    out.captured.append(ready)
                if ready.endswith(_DONE):
                    # The client may hang up as soon as it reads [DONE] (the openai package
                    # does), so the reply ends here; the upstream's end is read afterwards.
                    await send({"type": "http.response.body", "body": ready})
                    await _drain(response, deadline)
                    return None
                await send({"type": "http.response.body", "body": ready, "more_body": True})
        try:
            piece = await response.read(deadline)
        except UpstreamTimeout:
            failure = "client_deadline" if expired.code == "deadline_exceeded" else "timeout"
            body = sse_error(504, f"{expired.message} mid-stream", expired.code)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            out.error = f"{expired.message} mid-stream"
            break
        except UpstreamError as exc:
            failure = exc.kind
            message = f"the model server went away mid-stream ({exc})"
            await send(
                {
                    "type": "http.response.body",
                    "body": sse_error(502, message, "upstream_disconnected"),
                    "more_body": True,
                }
            )
            out.error = message
            break
    await send({"type": "http.response.body", "body": b""})
    return failure


async def _drain(response: Response, deadline: float) -> None:
    """Read an upstream body to its end after the client's reply is complete, so that the
    connection goes back to the pool. The request counts as in flight until then (the
    autoscaler reads that), so the pod gets at most ``_DRAIN`` seconds; one that misses
    them, or fails now, only costs its connection."""
    until = min(deadline, asyncio.get_running_loop().time() + _DRAIN)
    with contextlib.suppress(UpstreamError, UpstreamTimeout):
        await response.read_all(until)


def take_usage(events: bytes, out: Outcome, strip: bool) -> bytes:
    """Count the tokens of the usage event; drop it if the gateway, not the client, asked."""
    kept = []
    for event in events.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: ") and _USAGE.search(event):
            try:
                doc = json.loads(event[6:])
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                _read_usage(doc, out)
                if strip and not doc.get("choices"):
                    continue
        kept.append(event + b"\n\n")
    return b"".join(kept)


def usage_tokens(payload: bytes, out: Outcome) -> None:
    try:
        doc = json.loads(payload)
    except ValueError:
        return
    if isinstance(doc, dict):
        _read_usage(doc, out)


def _read_usage(doc: dict[str, Any], out: Outcome) -> None:
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return
    counts = [usage.get(k) for k in ("total_tokens", "prompt_tokens", "completion_tokens")]
    total, prompt, completion = (c if isinstance(c, int) else None for c in counts)
    out.tokens = total or 0
    out.prompt_tokens, out.completion_tokens = prompt, completion
