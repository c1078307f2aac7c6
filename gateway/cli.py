"""``ladle gateway``: flags, each also settable as a ``LADLE_GATEWAY_*`` environment variable
(``ladle.settings`` resolves them when the command runs).

Imports only the standard library at import time; uvicorn and friends load when it runs.
"""

from __future__ import annotations

import argparse
import socket

from ladle.audit import add_audit_args
from ladle.flag_types import existing_file, integer, memory, seconds, size_text
from ladle.gateway.settings import GatewaySettings
from ladle.settings import Default, add_log_level, add_tracing


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = GatewaySettings()
    parser = sub.add_parser(
        "gateway",
        help="the OpenAI-compatible front door for every InferenceService",
        description="Route OpenAI requests by model to the pods of InferenceServices, with "
        "prefix affinity, canary split, retries, outlier ejection, circuit breaking with "
        "fallback, API keys and limits. Every flag can also be set as a LADLE_GATEWAY_<FLAG> "
        "environment variable (upper case, dashes as underscores); the command line wins.",
    )
    parser.add_argument("--host", default=defaults.host, help="address to bind (pods: 0.0.0.0)")
    parser.add_argument(
        "--port", type=integer(0, 65535), default=defaults.port, help="port to bind"
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=Default([], "all namespaces"),
        help="watch InferenceServices in this namespace (repeatable; the variable takes a "
        "comma-separated list)",
    )
    parser.add_argument(
        "--static",
        type=existing_file,
        default=Default(None, "watch Kubernetes"),
        metavar="FILE",
        help="route to the services and endpoints listed in this YAML file instead of "
        "watching Kubernetes (docs/gateway.md shows the format)",
    )
    parser.add_argument(
        "--api-keys-file",
        type=existing_file,
        default=Default(None, "none: every request is accepted"),
        metavar="FILE",
        help="YAML list of API keys with names and optional limits (a mounted Secret)",
    )
    parser.add_argument(
        "--max-held-requests",
        type=integer(0),
        default=defaults.max_held_requests,
        help="per service, how many requests may wait for a free slot or a ready pod; past "
        "it the lowest priority band is shed with 429",
    )
    parser.add_argument(
        "--priority-bands",
        default=",".join(defaults.priority_bands),
        metavar="NAMES",
        help="priority bands, highest first, comma-separated: a request names its band in "
        "x-ladle-priority, or takes its API key's",
    )
    parser.add_argument(
        "--default-priority",
        default=defaults.default_priority,
        metavar="NAME",
        help="the band of a request that names none and whose key has none",
    )
    parser.add_argument(
        "--scrape-interval",
        type=seconds(0),
        default=defaults.scrape_interval,
        metavar="SECONDS",
        help="seconds between reads of each pod's queue and KV usage; 0 turns it off",
    )
    parser.add_argument(
        "--connect-timeout",
        type=seconds(above=0),
        default=defaults.connect_timeout,
        metavar="SECONDS",
        help="seconds to open a connection to a pod before trying another",
    )
    parser.add_argument(
        "--max-request-size",
        type=memory,
        default=Default(defaults.max_request_size, size_text(defaults.max_request_size)),
        metavar="SIZE",
        help="larger request bodies get 413 (a quantity such as 8Mi, or bytes)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=seconds(0),
        default=defaults.drain_timeout,
        metavar="SECONDS",
        help="after SIGTERM, seconds in-flight requests may take to finish",
    )
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=defaults.access_log,
        help="one JSON line per request",
    )
    parser.add_argument(
        "--write-status",
        action=argparse.BooleanOptionalAction,
        default=defaults.write_status,
        help="write breaker state and held requests into InferenceService status",
    )
    parser.add_argument(
        "--identity",
        default=Default(socket.gethostname, "the hostname"),
        help="this replica's name in status.gateway.breaker.reportedBy",
    )
    parser.add_argument(
        "--response-cache-size",
        type=memory,
        default=Default(defaults.response_cache_size, size_text(defaults.response_cache_size)),
        metavar="SIZE",
        help="memory for cached responses of services with spec.responseCache.enabled (least "
        "recently used out first; one answer takes at most an eighth)",
    )
    parser.add_argument(
        "--response-cache",
        action=argparse.BooleanOptionalAction,
        default=defaults.response_cache,
        help="answer repeated deterministic requests from memory, for services that opt in",
    )
    add_audit_args(parser)
    add_log_level(parser)
    add_tracing(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ladle.gateway.main import serve

    return serve(GatewaySettings.from_namespace(args))
