"""Kubernetes timestamps, written and read one way everywhere."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def rfc3339(epoch: float | None = None, digits: int = 0) -> str:
    """A Kubernetes timestamp (now, by default): metav1.Time has whole seconds, metav1.MicroTime
    (a Lease's times) six digits, and a rollout's status keeps milliseconds (3)."""
    scale = 10**digits
    whole, part = divmod(round((time.time() if epoch is None else epoch) * scale), scale)
    text = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{part:0{digits}d}Z" if digits else f"{text}Z"


def parse_rfc3339(stamp: object) -> float | None:
    """Seconds since the epoch of a Time or MicroTime; None if absent or unreadable."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
