"""``ladle gateway``: flags, each also settable as a ``LADLE_GATEWAY_*`` environment variable.

Imports only the standard library at import time; uvicorn and friends load when it runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def _env(name: str, default: str) -> str:
    return os.environ.get(f"LADLE_GATEWAY_{name}", default)


def _flag(name: str, default: bool) -> bool:
    return _env(name, "true" if default else "false").strip().lower() in ("1", "true", "yes", "on")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "gateway",
        help="the OpenAI-compatible front door for every InferenceService",
        description="Route OpenAI requests by model to the pods of InferenceServices, with "
        "prefix affinity, canary split, retries, outlier ejection, circuit breaking with "
        "fallback, API keys and limits. Flags default to LADLE_GATEWAY_<FLAG> environment "
        "variables where set.",
    )
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind")
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8080")))
    parser.add_argument(
        "--namespace",
        action="append",
        default=[n for n in _env("NAMESPACE", "").split(",") if n.strip()],
        help="watch InferenceServices in this namespace (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--static",
        default=_env("STATIC", "") or None,
        metavar="FILE",
        help="route to the services and endpoints listed in this YAML file instead of "
        "watching Kubernetes (docs/gateway.md shows the format)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=_env("API_KEYS_FILE", "") or None,
        metavar="FILE",
        help="YAML list of API keys with names and optional limits (a mounted Secret); "
        "without it the gateway accepts every request",
    )
    parser.add_argument(
        "--max-held-requests",
        type=int,
        default=int(_env("MAX_HELD_REQUESTS", "256")),
        help="per service, how many requests may wait for a ready pod (default: %(default)s)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=_seconds,
        default=float(_env("SCRAPE_INTERVAL", "2")),
        help="seconds between reads of each pod's queue and KV usage; 0 turns it off "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout", type=_seconds, default=float(_env("CONNECT_TIMEOUT", "5"))
    )
    parser.add_argument(
        "--max-request-size",
        default=_env("MAX_REQUEST_SIZE", "8MiB"),
        help="larger request bodies get 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=float(_env("DRAIN_TIMEOUT", "30")),
        help="after SIGTERM, seconds in-flight requests may take to finish (default: %(default)s)",
    )
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=_flag("ACCESS_LOG", True),
        help="one JSON line per request (default: on)",
    )
    parser.add_argument(
        "--write-status",
        action=argparse.BooleanOptionalAction,
        default=_flag("WRITE_STATUS", True),
        help="write breaker state and held requests into InferenceService status (default: on)",
    )
    parser.add_argument(
        "--identity",
        default=_env("IDENTITY", socket.gethostname()),
        help="this replica's name in status.gateway.breaker.reportedBy (default: hostname)",
    )
    parser.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "info").lower(),
        choices=("debug", "info", "warning", "error"),
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ladle.gateway.main import GatewaySettings, SettingsError, serve

    try:
        settings = GatewaySettings.from_namespace(args)
    except SettingsError as exc:
        print(f"ladle gateway: {exc}", file=sys.stderr)
        return 2
    return serve(settings)
