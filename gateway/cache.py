"""The gateway's response cache: a repeated deterministic request answered from memory.

Opt-in per InferenceService (``spec.responseCache.enabled``). Only deterministic requests are
cached: greedy (``temperature: 0``) or seeded (``seed`` set), whose other parameters are all
part of the key. The key is the service, its model revision (a digest of the spec's model,
quantization and engine settings, so a new model or a changed engine is never served an old
answer), the one variant that takes all traffic (nothing is cached during a canary split), the
endpoint, the request body and the API key's sharing scope (``cacheScope`` in the keys file,
the key's own name by default), so keys that must not share never do.

Bounded in bytes, least recently used out first. Pure except for the clock-free LRU state.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Fields that change neither the answer nor its bytes.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
# One entry may take at most this share of the cache, so one huge answer cannot flush it.
MAX_ENTRY_SHARE = 8


def cacheable(doc: dict[str, Any]) -> bool:
    """Whether the same body always gets the same answer: greedy, or seeded."""
    temperature = doc.get("temperature", 1.0)
    seed = doc.get("seed")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if greedy and temperature == 0:
        return True
    return isinstance(seed, int) and not isinstance(seed, bool)


def cache_key(
    service: tuple[str, str],
    revision: str,
    variant: str,
    scope: str,
    path: bytes,
    doc: dict[str, Any],
) -> bytes:
    body = {k: v for k, v in doc.items() if k not in _IGNORED}
    material = json.dumps(
        [*service, revision, variant, scope, path.decode(), body],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(material.encode()).digest()


@dataclass(frozen=True)
class Entry:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    stream: bool

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + 64


class ResponseCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Entry) -> bool:
        """Store ``entry``; False when it is too large to be worth a place."""
        if entry.size > self.max_bytes // MAX_ENTRY_SHARE:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[key] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
            self.evictions += 1
        return True
