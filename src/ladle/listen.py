"""The listening socket of ``ladle serve`` and ``ladle gateway``, bound before anything else
starts: a port already taken is the most common first mistake, and it deserves one line naming
``--host``/``--port`` rather than uvicorn's error after the model has begun to load."""

from __future__ import annotations

import errno
import socket

from ladle.settings import SettingError


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket (SO_REUSEADDR, as uvicorn's own) for uvicorn's ``sockets=``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise SettingError(
            f"--host {host!r}: not an address of this machine ({err.strerror})"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        hint = (
            "another process listens there: stop it or choose another --port"
            if err.errno == errno.EADDRINUSE
            else "choose an address of this machine with --host"
        )
        raise SettingError(f"cannot listen on {host}:{port}: {err.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock
