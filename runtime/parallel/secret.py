"""The secret that ranks on several machines share: a module of its own, free of torch, so that
``ladle serve`` refuses a missing one before anything heavy loads."""

from __future__ import annotations

import os

from ladle.runtime.config import ConfigError

SECRET_VARIABLE = "LADLE_PARALLEL_SECRET"


def parallel_secret() -> bytes:
    """What ranks on several machines prove to one another (HMAC, ``multiprocessing``'s
    handshake) before any plan, which is pickled, crosses the network."""
    secret = os.environ.get(SECRET_VARIABLE, "")
    if not secret:
        raise ConfigError(
            f"nnodes > 1 needs {SECRET_VARIABLE}: the same secret on every node, which "
            "authenticates the ranks to one another"
        )
    return secret.encode()
