"""The runtime's half of the audit trail (``ladle.audit``): what one HTTP request asked and got.

The middleware opens an :class:`AuditEntry` per request and writes it when the response has
gone, whatever its status; the serving layer fills in what only it knows (model, parameters,
token counts, timings and, when opted in, the text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ladle.audit import outcome
from ladle.runtime.server.metrics import RequestRecord


@dataclass
class AuditEntry:
    key: str | None = None
    text: bool = False
    model: str | None = None
    params: dict[str, Any] | None = None
    stream: bool | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    queue_s: float | None = None
    ttft_s: float | None = None
    prompts: list[str] = field(default_factory=list)
    # Each choice's shown text, by choice index (what the client read, after output filters).
    outputs: dict[int, list[str]] = field(default_factory=dict)
    filtered: list[str] = field(default_factory=list)
    error: str | None = None

    def begin(
        self, model: str, params: dict[str, Any], stream: bool, prompts: list[str | None]
    ) -> None:
        self.model, self.params, self.stream = model, params, stream
        if self.text:
            self.prompts = [p or "" for p in prompts]

    def engine_request(self, record: RequestRecord) -> None:
        """One engine request ended (a request with several prompts runs several)."""
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens
        self.finish_reasons.append(record.finish_reason)
        timings = record.timings()
        for name in ("queue_s", "ttft_s"):
            value, current = timings[name], getattr(self, name)
            if value is not None and (current is None or value < current):
                setattr(self, name, value)
        if record.error is not None:
            self.error = record.error

    def shown(self, index: int, text: str) -> None:
        if self.text and text:
            self.outputs.setdefault(index, []).append(text)

    def fields(self, endpoint: str, status: int, duration: float) -> dict[str, Any]:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        record: dict[str, Any] = {
            "key": self.key,
            "endpoint": endpoint,
            "model": self.model,
            "params": self.params,
            "stream": self.stream,
            "status": status,
            "outcome": outcome(status),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reasons": self.finish_reasons,
            "duration_s": round(duration, 4),
            "queue_s": rounded(self.queue_s),
            "ttft_s": rounded(self.ttft_s),
        }
        if self.filtered:
            record["filtered"] = self.filtered
        if self.error is not None:
            record["error"] = self.error
        if self.text:
            record["prompt"] = self.prompts
            record["output"] = ["".join(self.outputs.get(i, [])) for i in sorted(self.outputs)]
        return record
