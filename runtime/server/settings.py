"""``ladle serve`` flags, resolved as command line > ``LADLE_*`` environment > ``--config`` YAML.

Pods are configured from a ConfigMap (the YAML file, keyed by flag name) and from environment
variables, so every flag can come from all three places. Only the standard library is imported
here: ``ladle --help`` must not pay for torch or FastAPI.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ladle.runtime.config import ConfigError, parse_memory_size

ENV_PREFIX = "LADLE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ConfigError(f"max-waiting-requests must be >= 0; got {self.max_waiting_requests}")
        if self.drain_timeout < 0:
            raise ConfigError(f"drain-timeout must be >= 0; got {self.drain_timeout}")
        if self.liveness_timeout <= 0:
            raise ConfigError(f"liveness-timeout must be > 0; got {self.liveness_timeout}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ConfigError(f"request-timeout must be > 0; got {self.request_timeout}")
        self.max_request_size = parse_memory_size(self.max_request_size)

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
        )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--config", help="YAML file of settings keyed by flag name")
    group.add_argument(
        "--api-key",
        action="append",
        help="accept this bearer key (repeatable; the environment takes a comma-separated list)",
    )
    group.add_argument(
        "--api-key-file",
        help="file with one key per line (a mounted Secret); re-read when it changes",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        help="answer 429 when admitting a request would leave more than this many sequences "
        "waiting to be scheduled; n, best_of, beams and prompts each count (default: no limit)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted",
    )
    group.add_argument(
        "--log-prompts",
        action="store_true",
        default=False,
        help="log prompt text (it may hold personal data)",
    )
    group.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    group.add_argument("--max-request-size", default="8MiB", help="larger request bodies get 413")
    group.add_argument(
        "--liveness-timeout",
        type=float,
        default=60.0,
        help="/health/live fails once one engine step runs longer than this many seconds, or "
        "work has waited this long without a token computed",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        help="abort a request this many seconds after it arrived, freeing its KV blocks; a "
        "request's own 'timeout' field overrides it (default: none)",
    )


class LayeredOptions:
    """Resolves a parser's flags from the command line, ``LADLE_*`` variables and a YAML file.

    The parser's own defaults are taken out (set to ``SUPPRESS``) so that the parsed namespace
    holds only what was typed; ``resolve`` then fills the rest from the lower layers.
    """

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._actions: dict[str, argparse.Action] = {}
        self._defaults: dict[str, Any] = {}
        for action in parser._actions:
            if not action.option_strings or action.dest in ("help", "config"):
                continue
            name = action.option_strings[0].removeprefix("--")
            self._actions[name] = action
            self._defaults[action.dest] = action.default
            if action.default not in (None, False):
                shown = f"default: {action.default}"
                action.help = f"{action.help} ({shown})" if action.help else shown
            action.default = argparse.SUPPRESS

    def resolve(
        self, typed: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> argparse.Namespace:
        env = os.environ if environ is None else environ
        values = dict(self._defaults)
        config = getattr(typed, "config", None) or env.get(f"{ENV_PREFIX}CONFIG")
        if config:
            values.update(self._from_yaml(Path(config)))
        for action in self._actions.values():
            raw = env.get(f"{ENV_PREFIX}{action.dest.upper()}")
            if raw is not None:
                values[action.dest] = self._convert(
                    action, raw, f"${ENV_PREFIX}{action.dest.upper()}"
                )
        values.update(vars(typed))
        return argparse.Namespace(**values)

    def _from_yaml(self, path: Path) -> dict[str, Any]:
        import yaml

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of flag names to values")
        values = {}
        for key, value in data.items():
            name = str(key).replace("_", "-")
            action = self._actions.get(name)
            if action is None:
                raise ConfigError(f"unknown setting {key!r} in {path}")
            values[action.dest] = self._convert(action, value, f"{key!r} in {path}")
        return values

    @staticmethod
    def _convert(action: argparse.Action, value: Any, where: str) -> Any:
        """Give a YAML or environment value the type the flag would have on the command line."""
        if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
            return text in _TRUE
        if isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else str(value).split(",")
            return [str(item).strip() for item in items if str(item).strip()]
        if value is None:
            return None
        if action.type is not None and isinstance(value, str):
            try:
                value = action.type(value)  # type: ignore[operator]
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: invalid value {value!r}") from None
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ConfigError(f"{where}: {value!r} is not one of {choices}")
        return value
