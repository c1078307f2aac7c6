"""``ladle bench serve``'s flags, vLLM's names for vLLM's meanings, and the readers of their
values (a server URL, percentiles, SLOs); a wrong value is one line naming the flag."""

from __future__ import annotations

import argparse
import math
import os

from ladle.flag_types import Invalid, integer, memory, number, seconds
from ladle.settings import Default

SLO_METRICS = ("ttft", "tpot", "e2el")


def base_url(text: str) -> str:
    """The server's root URL: the OpenAI base URL (``…/v1``) that servers print is accepted
    too, since endpoints are given with their ``/v1``."""
    from urllib.parse import urlsplit

    url = text.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise Invalid("expected an http:// or https:// URL such as http://127.0.0.1:8000/v1")
    return url.removesuffix("/v1")


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise Invalid("expected comma-separated percentiles in (0, 100], such as 50,90,99")
    return values


def _slo(text: str) -> str:
    name, sep, value = text.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not sep or name not in SLO_METRICS or not limit > 0:
        raise Invalid(f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0")
    return text


def _header(text: str) -> str:
    name, sep, _ = text.partition("=")
    if not sep or not name.strip() or any(c.isspace() for c in name):
        raise Invalid("expected KEY=VALUE, such as x-ladle-priority=sheddable")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from ladle.runtime.bench.workloads import WORKLOADS

    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        type=base_url,
        default="http://127.0.0.1:8000",
        metavar="URL",
        help="the server, with or without its /v1 (what ladle serve and ladle up print)",
    )
    target.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
        help="the API to load",
    )
    target.add_argument(
        "--model",
        default=Default(None, "the server's first model"),
        help="the `model` to send",
    )
    target.add_argument(
        "--api-key",
        default=Default(lambda: os.environ.get("OPENAI_API_KEY"), "$OPENAI_API_KEY"),
        help="bearer key for the server",
    )
    target.add_argument(
        "--timeout", type=seconds(above=0), default=3600.0, help="per request, seconds"
    )
    target.add_argument(
        "--header",
        nargs="+",
        action="extend",
        type=_header,
        default=Default([], "none"),
        metavar="KEY=VALUE",
        help="headers sent with every request, e.g. x-ladle-priority=sheddable",
    )

    data = parser.add_argument_group("requests")
    data.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=Default(None, "synthetic prompts from the flags below"),
        help="the engine benchmark's request set (sets prompts, count and output length)",
    )
    data.add_argument("--num-prompts", type=integer(1), default=32, help="requests to send")
    data.add_argument("--input-len", type=integer(1), default=128, help="prompt tokens")
    data.add_argument("--output-len", type=integer(1), default=128, help="max_tokens per request")
    data.add_argument(
        "--range-ratio",
        type=number(0, maximum=1, finite=True),
        default=0.0,
        help="draw input and output lengths uniformly from [len*(1-r), len*(1+r)]",
    )
    data.add_argument(
        "--temperature", type=number(0), default=0.0, help="sampling temperature; 0 is greedy"
    )
    data.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send vLLM's ignore_eos so every request generates its full output length",
    )
    data.add_argument(
        "--tokenizer",
        default=Default(None, "the embedded model's"),
        help="tokenizer folder for building prompts and counting tokens",
    )
    data.add_argument("--seed", type=integer(0), default=0, help="seed for lengths and arrivals")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=number(above=0, finite=False),
        default=math.inf,
        help="requests/s; inf sends them all at once",
    )
    load.add_argument(
        "--burstiness", type=number(above=0), default=1.0, help="gamma shape; 1 is Poisson"
    )
    load.add_argument(
        "--max-concurrency",
        type=integer(1),
        default=Default(None, "no cap"),
        help="cap on requests in flight",
    )

    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=Default([], "none"),
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:100 (metrics: ttft, tpot, e2el)",
    )
    report.add_argument(
        "--percentiles",
        type=_percentiles,
        default="50,90,99",
        help="latency percentiles to report, comma-separated",
    )
    report.add_argument("--label", default=Default(None, "none"), help="name of this run")
    report.add_argument(
        "--result-file", default=Default(None, "none"), help="write the results as JSON"
    )
    report.add_argument(
        "--offline",
        action="store_true",
        help="also run the same requests through Ladle's offline engine here, for the ratio",
    )
    report.add_argument(
        "--kv-cache-memory", type=memory, default="4Gi", help="the KV cache for --offline"
    )


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    """What every request carries: ``--header``'s, and the bearer key."""
    headers = dict(item.partition("=")[::2] for item in args.header)
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def parse_slos(items: list[str]) -> dict[str, float]:
    """``ttft:500`` → {"ttft": 0.5} (milliseconds on the command line, seconds inside)."""
    slos = {}
    for item in items:
        name, _, value = _slo(item).partition(":")
        slos[name] = float(value) / 1000.0
    return slos
