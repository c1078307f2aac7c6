"""One JSON-lines log format for every Ladle process: ``ladle serve``, ``ladle gateway``,
``ladle operator`` (kopf's records included) and the local cluster's node agent.

Every line has ``time`` (ISO 8601, UTC), ``level`` (``debug``, ``info``, ``warning`` or
``error``: the names ``--log-level`` takes), ``logger`` and ``message``. A line
about an HTTP request carries its ``request_id``; a line about a Kubernetes object carries
``object`` (``namespace/name``, or ``name`` for cluster-scoped ones) and, where known, ``kind``.
Errors go in ``error``, tracebacks in ``exc_info``.

Libraries' informational chatter (kopf's "Handler … succeeded" and "Activity … succeeded",
uvicorn's startup lines, aiohttp's and httpx's request lines) is logged at ``debug``: visible
with ``--log-level debug``, quiet otherwise. Their warnings and errors keep their level.

python-json-logger is imported only when logging is configured (``ladle --help`` stays light).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ladle_request_id", default=None
)

# Loggers whose INFO records are library chatter, logged at debug.
CHATTER = ("kopf", "uvicorn", "aiohttp", "httpx", "asyncio")
# Record attributes that libraries attach and that are not log fields.
_NOT_FIELDS = frozenset({"color_message", "k8s_ref", "k8s_skip", "settings"})


def object_id(namespace: str | None, name: str) -> str:
    """The ``object`` field: ``namespace/name``, or ``name`` for a cluster-scoped object (a
    GPUPool, a Node), so one object reads the same in every line whoever logs it."""
    return f"{namespace}/{name}" if namespace else name


class _Fields(logging.Filter):
    """Adds the current request's id and kopf's object reference; demotes chatter."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and record.name.split(".")[0] in CHATTER:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            if self.level > logging.DEBUG:
                return False
        if not hasattr(record, "request_id"):
            request_id = request_id_var.get()
            if request_id is not None:
                record.request_id = request_id
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, Mapping) and not hasattr(record, "object"):
            record.object = object_id(ref.get("namespace"), str(ref.get("name") or ""))
            if ref.get("kind") and not hasattr(record, "kind"):
                record.kind = ref["kind"]
        return True


def formatter() -> logging.Formatter:
    """The JSON-lines formatter every Ladle log (and the audit file) writes with."""
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    class Formatter(JsonFormatter):
        def add_fields(
            self,
            log_record: dict[str, Any],
            record: logging.LogRecord,
            message_dict: dict[str, Any],
        ) -> None:
            log_record["time"] = datetime.fromtimestamp(record.created, UTC).isoformat()
            log_record["level"] = record.levelname.lower()
            log_record["logger"] = record.name
            log_record["message"] = record.getMessage()
            super().add_fields(log_record, record, message_dict)

    return Formatter("", reserved_attrs=[*RESERVED_ATTRS, *_NOT_FIELDS])


def configure(level: str) -> None:
    """JSON lines on stderr from every logger, at ``level`` and above."""
    threshold = logging.getLevelName(level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter())
    handler.addFilter(_Fields(threshold))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Chatter is demoted by the handler, so its loggers must let INFO through to be shown at
    # debug; everything else is filtered at the root.
    root.setLevel(threshold)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class Recurring:
    """A failure that repeats (a missing file re-read on every request, an unreachable API
    server polled every second) is logged once when it starts or its cause changes, and once
    when it ends; not on every attempt."""

    def __init__(self, logger: logging.Logger, failing: str, recovered: str, **fields: Any):
        self.logger = logger
        self.messages = (failing, recovered)
        self.fields = fields
        self.error: str | None = None

    def failed(self, error: object) -> None:
        text = str(error)
        if text != self.error:
            self.logger.warning(self.messages[0], extra={**self.fields, "error": text})
        self.error = text

    def recovered(self, **fields: Any) -> None:
        if self.error is not None:
            self.logger.info(self.messages[1], extra={**self.fields, **fields})
        self.error = None
