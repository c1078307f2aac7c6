"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ladle.runtime.errors import RequestError

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each output carries: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParamsError(RequestError):
    """A sampling parameter is out of range; the message names it and its range."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param)


@dataclass
class SamplingParams:
    """Validated on construction so that a bad request fails before it reaches the scheduler."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}"
            )
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "token ids must be >= 0")
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters cannot change the argmax, so drop them to keep the batch cheap.
            self.temperature, self.top_p, self.top_k = 0.0, 1.0, 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
