"""The audit trail: one JSON record per request, written by the gateway and by the runtime, so
that who asked what, and what came of it, can be answered later (docs/pipeline.md).

Both write the same schema under the logger ``ladle.audit`` with the message ``audit``, and
both carry the request id the gateway hands the pod, so one request's two records join on
``request_id``. The API key appears by name (the gateway's keys file names them; ``ladle
serve``'s unnamed keys by a short SHA-256 fingerprint), never as the key. Prompt and output
text are recorded only with ``--audit-text``: they may hold personal data.

``--audit-log -`` writes the records into the process's JSON log on stderr (at any
``--log-level``: an audit record is not chatter); ``--audit-log FILE`` appends them, one JSON
object a line, to a file of their own, for a log shipper to tail.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from ladle.flag_types import Invalid

LOGGER = "ladle.audit"
MESSAGE = "audit"
# Bumped when a field changes meaning or goes away; new fields may appear within a version.
VERSION = 1
STDERR = "-"


def destination(value: str) -> str | None:
    """``off`` (none), ``-`` (the process's log) or a file whose folder exists."""
    raw = str(value).strip()
    if raw.lower() in ("off", "none", ""):
        return None
    if raw == STDERR:
        return STDERR
    path = Path(raw).expanduser()
    if not path.parent.is_dir():
        raise Invalid(f"expected off, - or a file in an existing folder; no folder {path.parent}")
    if path.is_dir():
        raise Invalid(f"expected a file, not the folder {path}")
    return str(path)


destination.__dict__.update(metavar="DEST", allowed="expected off, - or a file path")


def add_audit_args(parser: Any) -> None:
    """``--audit-log`` and ``--audit-text``, spelled the same in serve and gateway."""
    parser.add_argument(
        "--audit-log",
        type=destination,
        default="off",
        help="one audit record per request (docs/pipeline.md): off, - for this process's log "
        "on stderr, or a file to append JSON lines to",
    )
    parser.add_argument(
        "--audit-text",
        action="store_true",
        default=False,
        help="add prompt and output text to audit records (they may hold personal data)",
    )


def fingerprint(key: str) -> str:
    """What a record shows for a key without a name: enough to tell keys apart, not to use."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class AuditLog:
    """Where one process writes its audit records; ``enabled`` is false for ``off``."""

    def __init__(self, dest: str | None, component: str, *, text: bool = False) -> None:
        self.enabled = dest is not None
        self.text = text and self.enabled
        self.component = component
        self._logger = logging.getLogger(f"{LOGGER}.{component}")
        self._logger.setLevel(logging.INFO)
        if dest is not None and dest != STDERR:
            from ladle.logs import formatter

            handler = logging.FileHandler(dest, encoding="utf-8")
            handler.setFormatter(formatter())
            self._logger.handlers[:] = [handler]
            self._logger.propagate = False
        else:
            self._logger.handlers.clear()
            self._logger.propagate = True

    def write(self, request_id: str, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {
            "audit_version": VERSION,
            "component": self.component,
            "request_id": request_id,
            **fields,
        }
        self._logger.info(MESSAGE, extra=record)

    def close(self) -> None:
        for handler in self._logger.handlers:
            handler.close()


def outcome(status: int) -> str:
    """One word for a status: ``ok``, ``rejected`` (4xx), ``client_closed`` (499) or ``error``."""
    if status == 499:
        return "client_closed"
    if 200 <= status < 400:
        return "ok"
    if 400 <= status < 500:
        return "rejected"
    return "error"
