"""``ladle serve``'s own flags (the engine's are in ``ladle.runtime.config``).

Every flag can also come from a ``LADLE_SERVE_*`` variable or a ``--config`` YAML file keyed by
flag name (``ladle.settings`` resolves them): pods are configured from a ConfigMap holding that
file. Only the standard library is imported here: ``ladle --help`` must not pay for FastAPI.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from ladle.audit import add_audit_args
from ladle.flag_types import Invalid, existing_file, integer, memory, seconds, size_text
from ladle.runtime.config import ConfigError, parse_memory_size
from ladle.runtime.server.profiles import ENV_PROFILES
from ladle.settings import Default, add_env_profile, add_log_level, add_tracing


@dataclass
class ServerSettings:
    """Everything about the HTTP server that is not an engine argument."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    api_key_file: Path | None = None
    max_waiting_requests: int | None = None
    drain_timeout: float = 30.0
    log_prompts: bool = False
    log_level: str = "info"
    max_request_size: int = 8 << 20
    liveness_timeout: float = 60.0
    request_timeout: float | None = None
    audit_log: str | None = None
    audit_text: bool = False
    input_filters: list[str] = field(default_factory=list)
    output_filters: list[str] = field(default_factory=list)
    profile_dir: Path | None = None
    profile_max_seconds: float = 60.0
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    # (name, folder) of each LoRA adapter served from the start.
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    lora_modules_file: Path | None = None

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ConfigError(f"max-waiting-requests must be >= 0; got {self.max_waiting_requests}")
        if self.drain_timeout < 0:
            raise ConfigError(f"drain-timeout must be >= 0; got {self.drain_timeout}")
        if self.liveness_timeout <= 0:
            raise ConfigError(f"liveness-timeout must be > 0; got {self.liveness_timeout}")
        if not 0 < self.profile_max_seconds < float("inf"):
            raise ConfigError(f"profile-max-seconds must be > 0; got {self.profile_max_seconds}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ConfigError(f"request-timeout must be > 0; got {self.request_timeout}")
        self.max_request_size = parse_memory_size(self.max_request_size)
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"lora-modules: each name once; given twice: {', '.join(twice)}")
        if self.profile_dir is not None and not (self.api_keys or self.api_key_file):
            raise ConfigError(
                "profile-dir needs --api-key or --api-key-file: the profiler endpoints must "
                "not be open to anyone who can reach the port"
            )

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(
            host=args.host,
            port=args.port,
            api_keys=list(args.api_key or []),
            api_key_file=None if args.api_key_file is None else Path(args.api_key_file),
            max_waiting_requests=args.max_waiting_requests,
            drain_timeout=args.drain_timeout,
            log_prompts=args.log_prompts,
            log_level=args.log_level,
            max_request_size=args.max_request_size,
            liveness_timeout=args.liveness_timeout,
            request_timeout=args.request_timeout,
            audit_log=args.audit_log,
            audit_text=args.audit_text,
            input_filters=list(args.input_filter or []),
            output_filters=list(args.output_filter or []),
            profile_dir=None if args.profile_dir is None else Path(args.profile_dir),
            profile_max_seconds=args.profile_max_seconds,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            trace_sample_ratio=args.trace_sample_ratio,
            lora_modules=list(args.lora_modules or []),
            lora_modules_file=None
            if args.lora_modules_file is None
            else Path(args.lora_modules_file),
        )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    defaults = ServerSettings()
    group.add_argument("--host", default=defaults.host, help="address to bind (pods: 0.0.0.0)")
    group.add_argument("--port", type=integer(0, 65535), default=defaults.port, help="port to bind")
    group.add_argument(
        "--config",
        default=Default(None, "none"),
        metavar="FILE",
        help="YAML file of settings keyed by flag name (docs/server.md)",
    )
    add_env_profile(group, ENV_PROFILES, "docs/server.md#environment-profiles")
    group.add_argument(
        "--api-key",
        action="append",
        default=Default([], "none: no key needed"),
        metavar="KEY",
        help="accept this bearer key (repeatable; the variable takes a comma-separated list)",
    )
    group.add_argument(
        "--api-key-file",
        type=existing_file,
        default=Default(None, "none"),
        metavar="FILE",
        help="file with one key per line (a mounted Secret); re-read when it changes",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=integer(0),
        default=Default(None, "no limit"),
        metavar="N",
        help="answer 429 when admitting a request would leave more than this many sequences "
        "waiting to be scheduled; n, best_of, beams and prompts each count",
    )
    group.add_argument(
        "--drain-timeout",
        type=seconds(0),
        default=defaults.drain_timeout,
        metavar="SECONDS",
        help="seconds in-flight requests may run after SIGTERM before they are aborted",
    )
    group.add_argument(
        "--log-prompts",
        action="store_true",
        default=defaults.log_prompts,
        help="log prompt text (it may hold personal data)",
    )
    add_log_level(group)
    group.add_argument(
        "--max-request-size",
        type=memory,
        default=Default(defaults.max_request_size, size_text(defaults.max_request_size)),
        metavar="SIZE",
        help="larger request bodies get 413 (a quantity such as 8Mi, or bytes)",
    )
    group.add_argument(
        "--liveness-timeout",
        type=seconds(above=0),
        default=defaults.liveness_timeout,
        metavar="SECONDS",
        help="/health/live fails once one engine step runs longer than this many seconds, or "
        "work has waited this long without a token computed",
    )
    group.add_argument(
        "--request-timeout",
        type=seconds(above=0),
        default=Default(None, "none"),
        metavar="SECONDS",
        help="abort a request this many seconds after it arrived, freeing its KV blocks; a "
        "request's own 'timeout' field overrides it",
    )
    add_audit_args(group)
    group.add_argument(
        "--input-filter",
        action="append",
        default=Default([], "none"),
        metavar="NAME",
        help="refuse requests this filter rejects, before admission: a ladle.filters entry "
        "point (pii is built in) or package.module:Name (repeatable; docs/pipeline.md)",
    )
    group.add_argument(
        "--output-filter",
        action="append",
        default=Default([], "none"),
        metavar="NAME",
        help="pass generated text through this filter as it streams, which may redact or stop "
        "it: an entry point (pii is built in) or package.module:Name (repeatable)",
    )
    group.add_argument(
        "--profile-dir",
        default=Default(None, "off"),
        metavar="DIR",
        help="turn on POST /start_profile and /stop_profile (torch.profiler), writing traces "
        "here; needs --api-key or --api-key-file (docs/pipeline.md)",
    )
    group.add_argument(
        "--profile-max-seconds",
        type=seconds(above=0),
        default=defaults.profile_max_seconds,
        metavar="SECONDS",
        help="a profile still running this long after /start_profile stops itself and writes "
        "its trace",
    )
    add_tracing(group)
    group.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        action="extend",
        default=Default([], "none"),
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve from the start, each under its own model "
        "name; needs --enable-lora",
    )
    group.add_argument(
        "--lora-modules-file",
        type=existing_file,
        default=Default(None, "none"),
        metavar="FILE",
        help="YAML list of {name, path}: adapters to serve, read again whenever it changes "
        "(a mounted ConfigMap); needs --enable-lora",
    )


def lora_module(text: str) -> tuple[str, str]:
    """vLLM's two spellings: ``name=path``, or ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise Invalid('expected NAME=PATH or {"name": ..., "path": ...}') from None
        if not isinstance(value, dict):
            raise Invalid('expected NAME=PATH or {"name": ..., "path": ...}')
        name, path = value.get("name"), value.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path:
        raise Invalid('expected NAME=PATH or {"name": ..., "path": ...}')
    return name.strip(), path
