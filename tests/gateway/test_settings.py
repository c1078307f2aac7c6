"""``ladle gateway``'s flags and the settings a gateway is built from share their defaults."""

from __future__ import annotations

import dataclasses
import socket

from ladle.cli import build_parser
from ladle.gateway.settings import GatewaySettings
from ladle.settings import parse, resolve


def settings(*argv: str, **environ: str) -> GatewaySettings:
    parser = build_parser()
    return GatewaySettings.from_namespace(resolve(parse(parser, ["gateway", *argv]), environ))


def test_the_command_without_flags_is_the_default_settings() -> None:
    # The identity is the one default computed when the command runs: the pod's hostname.
    assert settings() == dataclasses.replace(GatewaySettings(), identity=socket.gethostname())


def test_sizes_and_namespaces_read_as_the_fields_hold_them() -> None:
    read = settings("--max-request-size", "1Mi", "--namespace", "a", "--namespace", "b")
    assert (read.max_request_size, read.namespaces, read.namespaces_all) == (
        1 << 20,
        ("a", "b"),
        False,
    )
    from_env = settings(LADLE_GATEWAY_RESPONSE_CACHE_SIZE="64Mi", LADLE_GATEWAY_NAMESPACE="x, y")
    assert (from_env.response_cache_size, from_env.namespaces) == (64 << 20, ("x", "y"))
