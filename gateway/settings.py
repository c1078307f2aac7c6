"""``ladle gateway``'s settings: one dataclass whose defaults are the flags' defaults
(``gateway/cli.py`` reads them from here). Only the standard library, for ``ladle --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from ladle.settings import SettingError

_BAND = re.compile(r"[a-z][a-z0-9-]{0,31}")


# Priority bands, highest first, as the Gateway API Inference Extension's criticalities read.
DEFAULT_BANDS = ("critical", "standard", "sheddable")


class SettingsError(SettingError):
    """A setting the gateway cannot start with (the command prints it in one line)."""


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8080
    namespaces: tuple[str, ...] = ()
    static: Path | None = None
    api_keys_file: Path | None = None
    max_held_requests: int = 256
    priority_bands: tuple[str, ...] = DEFAULT_BANDS
    default_priority: str = "standard"
    scrape_interval: float = 2.0
    connect_timeout: float = 5.0
    max_request_size: int = 8 << 20
    drain_timeout: float = 30.0
    access_log: bool = True
    write_status: bool = True
    identity: str = "ladle-gateway"
    log_level: str = "info"
    audit_log: str | None = None
    audit_text: bool = False
    response_cache: bool = True
    response_cache_size: int = 256 << 20
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    namespaces_all: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "namespaces_all", not self.namespaces)
        if self.max_held_requests < 0:
            raise SettingsError(f"--max-held-requests must be >= 0, got {self.max_held_requests}")
        bands = self.priority_bands
        if not bands or len(set(bands)) != len(bands) or not all(_BAND.fullmatch(b) for b in bands):
            raise SettingsError(
                "--priority-bands must list distinct lowercase names, highest first, such as "
                f"{','.join(DEFAULT_BANDS)}; got {','.join(bands)!r}"
            )
        if self.default_priority not in bands:
            raise SettingsError(
                f"--default-priority must be one of the bands ({', '.join(bands)}), "
                f"got {self.default_priority!r}"
            )

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> GatewaySettings:
        """The settings from ``ladle gateway``'s parsed flags, named as the fields are
        (``--namespace``, repeatable, fills ``namespaces``)."""
        names = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "namespaces"]
        namespaces = tuple(dict.fromkeys(n.strip() for n in args.namespace if n.strip()))
        values = {name: getattr(args, name) for name in names}
        if isinstance(values["priority_bands"], str):
            values["priority_bands"] = tuple(b.strip() for b in values["priority_bands"].split(","))
        return cls(namespaces=namespaces, **values)
