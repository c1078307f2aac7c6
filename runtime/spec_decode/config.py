"""``--speculative-config``, read as vLLM reads it (``{"method": "ngram",
"num_speculative_tokens": 5, "prompt_lookup_max": 4}``), so that users' configs carry over."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ladle.settings import SettingError

METHODS = ("ngram", "draft_model")
# The most draft tokens one step verifies: beyond this a step mostly computes rejected tokens.
MAX_SPECULATIVE_TOKENS = 16
# n-gram sizes when the config gives neither (vLLM's choice).
DEFAULT_LOOKUP = 5
# The draft model's weights, rounded at load (int4 unless given); none only for another model.
DRAFT_QUANTIZATIONS = ("int4", "int8", "none")
_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"model", "quantization"},
}


class SpeculativeConfigError(SettingError):
    """A speculative config that cannot run; the message names the key and what is allowed."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    # draft_model: the drafter's folder (None: the served model itself) and the weights it
    # is rounded to at load.
    model: str | None = None
    quantization: str = "int4"

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
        method = raw.get("method")
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative config: method must be one of {', '.join(METHODS)}; got {method!r}"
            )
        known = {"method", "num_speculative_tokens", *_KEYS[method]}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative config: unknown key {unknown[0]!r} for method {method}; known: "
                f"{', '.join(sorted(known))}"
            )
        k = _int(raw, "num_speculative_tokens")
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative config: num_speculative_tokens must be 1 to "
                f"{MAX_SPECULATIVE_TOKENS}; got {raw.get('num_speculative_tokens')!r}"
            )
        if method == "draft_model":
            return cls._draft_model(raw, k)
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

    @classmethod
    def _draft_model(cls, raw: Mapping[str, Any], k: int) -> SpeculativeConfig:
        quantization = raw.get("quantization", "int4")
        if quantization not in DRAFT_QUANTIZATIONS:
            raise SpeculativeConfigError(
                f"speculative config: quantization must be one of "
                f"{', '.join(DRAFT_QUANTIZATIONS)}; got {quantization!r}"
            )
        model = raw.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise SpeculativeConfigError(
                f"speculative config: model must be a folder's path; got {model!r}"
            )
        if model is None and quantization == "none":
            raise SpeculativeConfigError(
                "speculative config: quantization none drafts with the model itself, which "
                "saves nothing; use int4 or int8, or name another model"
            )
        return cls("draft_model", k, model=model, quantization=quantization)


def _int(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"speculative config: {key} must be an integer; got {value!r}")
    return value
