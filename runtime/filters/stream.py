"""Output filters applied to one choice's stream of engine deltas, keeping tokens and logprobs
aligned with the text.

A delta (its text, token ids and logprobs) is the unit that moves: it is shown whole, once the
filters have settled all of its text, or held back with its tokens. A span a filter replaces
may cover several deltas; those go out together, their text replaced, and their tokens keep
their ids and logprobs but carry ``token_texts``: the first token the span's shown text, the
others ``""``, so that the tokens' texts still add up to the text and none of them shows what
was redacted. A stop ends the text inside the delta that holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ladle.runtime.filters import Edit, OutputFilter


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    logprobs: list[Any] = field(default_factory=list)
    # Per token, the text to show in place of its own (None: its own), once filtered.
    token_texts: list[str | None] = field(default_factory=list)


def merge_edits(edits: Sequence[Edit]) -> list[Edit]:
    """Several filters' edits as one ordered, non-overlapping list; the earliest stop wins."""
    kept: list[Edit] = []
    end = -1
    for edit in sorted(edits, key=lambda e: (e.start, not e.stop, -e.end)):
        if edit.start < end and not edit.stop:
            continue
        if edit.start < end:
            # A stop inside a replaced span ends the text where that span begins.
            kept.append(dataclasses.replace(edit, start=kept.pop().start))
            break
        kept.append(edit)
        if edit.stop:
            break
        end = edit.end
    return kept


def apply_edits(text: str, offset: int, edits: Sequence[Edit]) -> str:
    """``text`` (which starts at ``offset`` in the whole) with the edits inside it applied."""
    out: list[str] = []
    position = offset
    for edit in edits:
        out.append(text[position - offset : edit.start - offset])
        if edit.stop:
            return "".join(out)
        out.append(edit.replacement)
        position = edit.end
    out.append(text[position - offset :])
    return "".join(out)


class FilteredText:
    """One choice's text through a chain of output filters."""

    def __init__(self, filters: Sequence[OutputFilter]) -> None:
        self.filters = list(filters)
        self.raw = ""
        self.shown_upto = 0  # characters of ``raw`` decided and handed out
        self.pending: list[Piece] = []
        self.stopped_by: str | None = None
        self.changed_by: set[str] = set()

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def push(self, piece: Piece, final: bool) -> list[Piece]:
        """Take one delta; return what may be shown now (everything, when ``final``)."""
        if self.stopped:
            return []
        self.pending.append(piece)
        self.raw += piece.text
        edits = merge_edits(
            [
                dataclasses.replace(edit, by=f.name)
                for f in self.filters
                for edit in f.scan(self.raw, self.shown_upto)
            ]
        )
        stop = next((e for e in edits if e.stop), None)
        limit = len(self.raw)
        if not final:
            settled = min(f.settled(self.raw) for f in self.filters)
            limit = max(self.shown_upto, min(limit, settled))
        if stop is not None:
            limit = stop.start
        if stop is None:
            limit = self._cut(limit, edits)
        out = self._take(limit, [e for e in edits if e.start < limit or e.stop], stop)
        if stop is not None:
            self.stopped_by = stop.by
            self.changed_by.add(stop.by)
            self.pending = []
        return out

    def _cut(self, limit: int, edits: list[Edit]) -> int:
        """The last delta boundary by ``limit`` that no replaced span runs across: a span
        waits, whole, with the deltas it covers, until all of it is settled."""
        boundaries = [self.shown_upto]
        for piece in self.pending:
            boundaries.append(boundaries[-1] + len(piece.text))
        while True:
            cut = max(b for b in boundaries if b <= limit)
            crossing = [e.start for e in edits if e.start < cut < e.end]
            if not crossing:
                return cut
            limit = min(crossing)

    def _take(self, limit: int, edits: list[Edit], stop: Edit | None) -> list[Piece]:
        """The pending deltas that end by ``limit`` (with a stop: through the one holding it),
        grouped so that every replaced span goes out with the deltas it covers."""
        spans: list[tuple[int, int, Piece]] = []
        start = self.shown_upto
        for piece in self.pending:
            end = start + len(piece.text)
            if end > limit and not (stop is not None and start <= stop.start):
                break
            spans.append((start, end, piece))
            start = end
        if not spans:
            return []
        self.pending = self.pending[len(spans) :]
        self.shown_upto = spans[-1][1]
        out: list[Piece] = []
        group: list[tuple[int, int, Piece]] = []
        for span in spans:
            if group and _crosses(group[-1][1], edits):
                group.append(span)
                continue
            if group:
                out.append(self._group(group, edits))
                group = []
            if _touches(span[0], span[1], edits):
                group = [span]
            else:
                out.append(span[2])
        if group:
            out.append(self._group(group, edits))
        return out

    def _group(self, group: list[tuple[int, int, Piece]], edits: list[Edit]) -> Piece:
        begin, end = group[0][0], group[-1][1]
        inside = [e for e in edits if _touches(begin, end, [e])]
        text = apply_edits(self.raw[begin:end], begin, inside)
        self.changed_by.update(e.by for e in inside)
        ids = [t for _, _, p in group for t in p.token_ids]
        logprobs = [lp for _, _, p in group for lp in p.logprobs]
        texts: list[str | None] = [text, *[""] * (len(ids) - 1)] if ids else []
        return Piece(text, ids, logprobs, texts)


def _crosses(boundary: int, edits: list[Edit]) -> bool:
    """Whether a replaced span runs across ``boundary``: the deltas on both sides go as one."""
    return any(e.start < boundary < e.end for e in edits if not e.stop)


def _touches(start: int, end: int, edits: list[Edit]) -> bool:
    return any(
        (start <= e.start < end) if e.stop else (e.start < end and e.end > start) for e in edits
    )
