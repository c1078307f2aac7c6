"""Errors a caller can fix; servers turn them into 4xx responses naming ``param``."""

from __future__ import annotations


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def require_text(value: str, param: str) -> str:
    """JSON can carry lone surrogates (``"\\ud800"``), which are not text any tokenizer can
    encode: refuse them by name instead of failing inside the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"{param}: must be valid Unicode text (it holds a lone surrogate)", param
        ) from None
    return value
