"""JSON-lines logging for the server, uvicorn and the engine alike.

Every record logged while a request is handled carries its ``request_id``, so one grep finds
everything about a request, whichever logger wrote it.
"""

from __future__ import annotations

import contextvars
import logging
import sys

from pythonjsonlogger.json import JsonFormatter

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ladle_request_id", default=None
)


class _ContextFilter(logging.Filter):
    """Adds the current request's id; drops uvicorn's terminal-colour duplicate message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            request_id = request_id_var.get()
            if request_id is not None:
                record.request_id = request_id
        record.__dict__.pop("color_message", None)
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
        )
    )
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
