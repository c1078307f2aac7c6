"""``--speculative-config``, read as vLLM reads it (``{"method": "ngram",
"num_speculative_tokens": 5, "prompt_lookup_max": 4}``), so that users' configs carry over."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ladle.settings import SettingError

METHODS = ("ngram",)
# The most draft tokens one step verifies: beyond this a step mostly computes rejected tokens.
MAX_SPECULATIVE_TOKENS = 16
# n-gram sizes when the config gives neither (vLLM's choice).
DEFAULT_LOOKUP = 5


class SpeculativeConfigError(SettingError):
    """A speculative config that cannot run; the message names the key and what is allowed."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def parse(cls, raw: str | Mapping[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON text or a mapping; refuses what vLLM would, in its words."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"speculative config is not JSON: {exc}") from None
        if not isinstance(raw, Mapping):
            raise SpeculativeConfigError("speculative config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        method = raw.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative config: method must be one of {', '.join(METHODS)}; got {method!r}"
            )
        k = _int(raw, "num_speculative_tokens")
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative config: num_speculative_tokens must be 1 to "
                f"{MAX_SPECULATIVE_TOKENS}; got {raw.get('num_speculative_tokens')!r}"
            )
        low, high = _int(raw, "prompt_lookup_min"), _int(raw, "prompt_lookup_max")
        if low is None:
            low = DEFAULT_LOOKUP if high is None else high
        if high is None:
            high = low
        if not 1 <= low <= high:
            raise SpeculativeConfigError(
                f"speculative config: need 1 <= prompt_lookup_min <= prompt_lookup_max; "
                f"got {low} and {high}"
            )
        return cls(method, k, low, high)


def _int(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"speculative config: {key} must be an integer; got {value!r}")
    return value
