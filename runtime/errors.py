"""Errors a caller can fix; servers turn them into 4xx responses naming ``param``."""

from __future__ import annotations


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
