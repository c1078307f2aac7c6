"""API keys of the front door, from a mounted Secret, each with a name and optional limits.

The Secret holds one YAML document (``keys.yaml`` by default)::

    keys:
      - name: team-a            # what logs and metrics show; the key itself never appears
        key: sk-team-a-...
        requestsPerMinute: 600  # optional
        tokensPerMinute: 200000 # optional
        cacheScope: team-a      # optional: keys with one scope share cached responses
        priority: standard      # optional: the key's band, and the highest it may ask for

A rotated Secret is picked up without a restart: the file is re-read when its modification
time changes (checked at most once a second). Keys are looked up by their SHA-256, so the
lookup takes the same time whichever key, or non-key, is presented.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ladle.gateway.ratelimit import KeyLimiter
from ladle.gateway.settings import DEFAULT_BANDS
from ladle.logs import Recurring

log = logging.getLogger("ladle.gateway")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
RECHECK_SECONDS = 1.0


class KeyFileError(ValueError):
    """The keys file is missing or malformed; the message says where."""


@dataclass(frozen=True)
class KeySpec:
    name: str
    digest: bytes
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    # Keys with the same scope may be served each other's cached responses.
    cache_scope: str = ""
    # The key's priority band, and the highest its requests may ask for (None: any).
    priority: str | None = None


@dataclass
class ApiKey:
    spec: KeySpec
    limiter: KeyLimiter

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cache_scope(self) -> str:
        return self.spec.cache_scope or self.spec.name


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _limit(entry: dict[str, Any], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeyFileError(f"{where}: {field} must be a positive integer, got {value!r}")
    return value


def parse_keys(
    text: str, source: str = "keys file", bands: tuple[str, ...] = DEFAULT_BANDS
) -> list[KeySpec]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{source}: not valid YAML ({exc})") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: expected a mapping with a 'keys' list")
    specs: list[KeySpec] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, entry in enumerate(entries):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: expected a mapping with name and key")
        fields = {"name", "key", "requestsPerMinute", "tokensPerMinute", "cacheScope", "priority"}
        unknown = sorted(set(entry) - fields)
        if unknown:
            raise KeyFileError(f"{where}: unknown field {unknown[0]!r}")
        name, key = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise KeyFileError(
                f"{where}: name must be 1-63 letters, digits, '.', '_' or '-', got {name!r}"
            )
        if not isinstance(key, str) or len(key) < 8 or any(ch.isspace() for ch in key):
            raise KeyFileError(f"{where} ({name}): key must be at least 8 characters, no spaces")
        scope = entry.get("cacheScope", name)
        if not isinstance(scope, str) or not _NAME.fullmatch(scope):
            raise KeyFileError(f"{where} ({name}): cacheScope must be a name like {name!r}")
        priority = entry.get("priority")
        if priority is not None and priority not in bands:
            raise KeyFileError(
                f"{where} ({name}): priority must be one of {', '.join(bands)}, got {priority!r}"
            )
        if name in names:
            raise KeyFileError(f"{where}: the name {name!r} is used twice")
        d = digest(key)
        if d in digests:
            raise KeyFileError(f"{where} ({name}): the same key is listed twice")
        names.add(name)
        digests.add(d)
        specs.append(
            KeySpec(
                name,
                d,
                _limit(entry, "requestsPerMinute", where),
                _limit(entry, "tokensPerMinute", where),
                scope,
                priority,
            )
        )
    if not specs:
        raise KeyFileError(f"{source}: holds no key")
    return specs


class KeyStore:
    """The keys in force; limiter state survives a reload for keys whose limits are unchanged."""

    def __init__(self, path: Path, now: float, bands: tuple[str, ...] = DEFAULT_BANDS) -> None:
        self.path = path
        self.bands = bands
        self._by_digest: dict[bytes, ApiKey] = {}
        self._mtime: int | None = None
        self._checked = now
        self._state = Recurring(
            log,
            "keys file unusable; keeping the previous keys",
            "keys file usable again",
            path=str(path),
        )
        try:
            self._load(now)
        except OSError as exc:
            raise KeyFileError(f"cannot read the keys file {path}: {exc}") from None

    def lookup(self, presented: str, now: float) -> ApiKey | None:
        if now - self._checked >= RECHECK_SECONDS:
            self._checked = now
            try:
                self._load(now)
            except (OSError, KeyFileError) as exc:
                error = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                self._state.failed(error)
            else:
                self._state.recovered(keys=len(self._by_digest))
        return self._by_digest.get(digest(presented))

    def _load(self, now: float) -> None:
        mtime = os.stat(self.path).st_mtime_ns
        if mtime == self._mtime:
            return
        specs = parse_keys(self.path.read_text(), str(self.path), self.bands)
        old = {k.spec: k for k in self._by_digest.values()}
        self._by_digest = {
            s.digest: old.get(s)
            or ApiKey(s, KeyLimiter(s.requests_per_minute, s.tokens_per_minute, now))
            for s in specs
        }
        if self._mtime is not None:
            log.info("keys file reloaded", extra={"keys": len(specs)})
        self._mtime = mtime
