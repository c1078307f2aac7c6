"""Token buckets for per-key requests/min and tokens/min limits.

The request bucket is taken before the request is sent. Tokens are only known afterwards, so
the token bucket is debited with the response's usage and may go into debt; a key in debt is
refused until refill pays it back (the same idea as a leaky-bucket credit, and what LLM API
providers do). Pure: every method takes ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ladle.words import plural


class TokenBucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)

    def take(self, now: float, amount: float = 1.0) -> float:
        """Take ``amount`` if available and return 0; otherwise take nothing and return the
        seconds until it would be."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def debit(self, now: float, amount: float) -> None:
        """Charge ``amount`` after the fact; the level may go negative."""
        self._refill(now)
        self.level -= amount

    def wait(self, now: float) -> float:
        """Seconds until the bucket is out of debt (0 when it is not in debt)."""
        self._refill(now)
        return 0.0 if self.level > 0 else (-self.level + 1e-9) / self.rate


@dataclass(frozen=True)
class Refusal:
    limit: str  # "requests" or "tokens"
    retry_after: float
    message: str


class KeyLimiter:
    """The buckets of one API key; either limit may be absent."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None, now: float):
        self.requests = (
            None if requests_per_minute is None else TokenBucket(requests_per_minute, now)
        )
        self.tokens = None if tokens_per_minute is None else TokenBucket(tokens_per_minute, now)

    def admit(self, now: float) -> Refusal | None:
        if self.tokens is not None:
            wait = self.tokens.wait(now)
            if wait > 0:
                return Refusal(
                    "tokens",
                    wait,
                    f"this API key is over its limit of {plural(self.tokens.capacity, 'token')} "
                    f"per minute; retry in {wait:.1f} s",
                )
        if self.requests is not None:
            wait = self.requests.take(now)
            if wait > 0:
                return Refusal(
                    "requests",
                    wait,
                    "this API key is over its limit of "
                    f"{plural(self.requests.capacity, 'request')} per minute; "
                    f"retry in {wait:.1f} s",
                )
        return None

    def charge_tokens(self, now: float, tokens: int) -> None:
        if self.tokens is not None and tokens > 0:
            self.tokens.debit(now, tokens)
