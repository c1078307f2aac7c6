"""``ladle serve --env-profile``: defaults for a kind of deployment, keyed by flag name.

A profile sits under every other source (the command line, ``LADLE_SERVE_*``, the ``--config``
file), so it only moves defaults; docs/server.md has the table, and a test diffs the settings
each one yields.
"""

from __future__ import annotations

from typing import Any

ENV_PROFILES: dict[str, dict[str, Any]] = {
    # A laptop or a debugger: everything in the log, no restart while paused at a breakpoint,
    # and a quick exit on Ctrl-C.
    "dev": {
        "log-level": "debug",
        "log-prompts": True,
        "liveness-timeout": 600,
        "drain-timeout": 2,
    },
    # Production's limits and probes, with a more talkative log to catch problems before prod.
    "staging": {
        "log-level": "info",
        "audit-log": "-",
        "max-waiting-requests": 256,
        "request-timeout": 600,
        "liveness-timeout": 60,
        "drain-timeout": 30,
    },
    # Bounded work per request and in the queue, an audit record for every request, a quiet log.
    "prod": {
        "log-level": "warning",
        "audit-log": "-",
        "max-waiting-requests": 256,
        "request-timeout": 300,
        "max-request-size": "4Mi",
        "max-n": 16,
        "max-prompts": 64,
        "liveness-timeout": 60,
        "drain-timeout": 30,
    },
}
