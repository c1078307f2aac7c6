"""Input and output filters for ``ladle serve``: the plug-in interface (docs/pipeline.md).

An **input filter** sees a request after its prompt is rendered and before it is admitted, and
may refuse it: ``check`` raises :class:`Rejected`, and the client gets a 400 naming the filter
and its reason. An **output filter** sees each choice's generated text as it streams and may
replace spans of it (``Edit``) or end it there (``Edit(stop=True)``: the text from that point is
never shown, the engine request is aborted and the choice ends with ``finish_reason``
``content_filter``). One object may be both.

Filters are named on the command line by entry point (group ``ladle.runtime.filters``; ``pii`` is
built in) or by import path (``package.module:Name``); a class is instantiated without
arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class Rejected(Exception):
    """Raised by an input filter's ``check``: the message says why, for the client."""

    def __init__(self, reason: str, param: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.param = param


@dataclass(frozen=True)
class FilterRequest:
    """What an input filter may judge."""

    endpoint: str
    model: str
    # The prompts as the model will read them (chat: after the template).
    prompts: list[str]
    # Chat only: the messages as sent.
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` with ``replacement``, or, with ``stop``, show nothing from
    ``start`` on and end the choice."""

    start: int
    end: int
    replacement: str = ""
    stop: bool = False
    # The filter that asked for it (set by Ladle, for logs and the audit record).
    by: str = ""


@runtime_checkable
class InputFilter(Protocol):
    name: str

    def check(self, request: FilterRequest) -> None: ...


@runtime_checkable
class OutputFilter(Protocol):
    name: str

    def scan(self, text: str, start: int) -> Sequence[Edit]:
        """The edits to ``text`` (one choice's whole generated text so far) that begin at or
        after ``start`` (what is already shown is never revisited), in order, not overlapping.
        A match that might still grow must not be reported, or must lie past ``settled``."""
        ...

    def settled(self, text: str) -> int:
        """How much of ``text`` no continuation can change: text beyond it is held back until
        more arrives (or the choice ends), so a match cut by a chunk boundary is still found."""
        ...
